"""The engine's CPU threads: the CPUs this process may use, shared among the ranks on the machine, set
on the thread that runs the scheduler (OpenMP keeps the count per thread)."""

import os

import torch

from hicache import Engine
from hicache.engine.threads import cpu_threads, usable_cpus


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
