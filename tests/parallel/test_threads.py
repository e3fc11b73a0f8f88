"""The engine's CPU threads: the CPUs this process may use, shared among the ranks on the machine, set
on the thread that runs the scheduler (OpenMP keeps the count per thread); helper threads that run torch
ops run them serially."""

import os
import threading

import torch

from hicache import Engine
from hicache.cache.controller import SupervisedWorker, TransferOp
from hicache.parallel.threads import cpu_threads, serial_kernels, usable_cpus


def test_threads_follow_the_affinity_mask_and_the_user(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert usable_cpus() == len(os.sched_getaffinity(0))
    assert cpu_threads(1) == usable_cpus() and cpu_threads(usable_cpus() * 4) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2) == 3  # the user's count is per rank


def test_the_scheduler_thread_runs_on_the_engines_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        with Engine(model="tiny", disable_radix_cache=True) as engine:
            assert engine.call_in_loop(torch.get_num_threads) == 1
    finally:
        torch.set_num_threads(before)  # the engine set the caller's thread too; later tests expect theirs


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op_on_a_new_thread(setup) -> tuple[int, int]:
    """OS threads of this process before and after a new thread runs `setup` and then an op large enough for
    torch to split over every CPU, while that thread is still alive (its OpenMP team, if it started one, too)."""
    x = torch.ones(4_000_000)
    seen: list[tuple[int, int]] = []

    def helper() -> None:
        setup()
        before = _os_threads()
        torch.mul(x, 2).sum()
        seen.append((before, _os_threads()))

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    return seen[0]


def test_a_helper_thread_with_serial_kernels_starts_no_team_beside_the_schedulers():
    """A second OpenMP team, even idle, throttles the scheduler's workers (libgomp manages more threads than
    CPUs): a helper thread's ops run on it alone."""
    before, after = _parallel_op_on_a_new_thread(serial_kernels)
    assert after == before
    counts: list[int] = []  # and only that thread's: torch's count for other threads is what it was
    other = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    other.start()
    other.join()
    assert counts == [torch.get_num_threads()]
    if usable_cpus() > 1 and torch.get_num_threads() > 1:  # the control: without it, a team starts
        before, after = _parallel_op_on_a_new_thread(lambda: None)
        assert after > before


def test_the_tiers_transfer_workers_run_their_copies_serially():
    worker = SupervisedWorker("test")
    seen: list[int] = []
    worker.submit(TransferOp("backup", lambda _: seen.append(torch.get_num_threads()))).wait()
    worker.stop()
    assert seen == [1]
