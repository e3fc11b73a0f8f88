"""How many CPU threads each thread's kernels use.

A rank's compute: the CPUs this process may run on (its affinity mask, which containers and `taskset`
narrow; not every CPU of the machine, which `os.cpu_count()` reports), shared out among the ranks on this
machine; OMP_NUM_THREADS, when the user set it, is the count per rank. OpenMP keeps the count per calling
thread, so a rank sets it on the thread that runs its scheduler as well as where its model is built
(calibration's plans are keyed by the count).

Every other thread that runs torch ops (tier copies, the CP gather, P/D transfers) runs them on itself
alone (`serial_kernels`), and threads that only set things up exit (`on_own_thread`): libgomp throttles
the spin of every team's workers once it manages more threads than there are CPUs, so a second team,
even an idle one, makes each parallel region of the scheduler's step sleep and wake its workers
(docs/BENCHMARKS.md sections 41 and 43)."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_threads(ranks_here: int = 1) -> int:
    """Intra-op threads for each of the `ranks_here` ranks this machine runs."""
    requested = os.environ.get("OMP_NUM_THREADS", "")
    if requested.isdigit() and int(requested) > 0:
        return int(requested)
    return max(1, usable_cpus() // ranks_here)


def use_threads(threads: int) -> None:
    """This thread's kernels run on `threads` threads."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    logger.debug("%d intra-op threads on %s (%d CPUs usable)", threads, threading.current_thread().name, usable_cpus())


def serial_kernels() -> None:
    """The calling helper thread's torch ops run on it alone, never starting an OpenMP team of their own
    beside the scheduler's (the module's docstring: with the host tier's backups on a team of their own,
    smollm2's decode step took 17.8 ms against 12.3). Called at the start of a helper thread's loop.

    OpenMP's own call, not torch.set_num_threads: that also sets torch's process-wide count, which every
    thread that has not run a torch op yet takes as its own (a user's thread, the next engine's loading)."""
    torch.get_num_threads()  # torch gives this thread its process-wide count on its first call: before ours
    openmp = ctypes.CDLL(None)  # the process's symbols: torch's libgomp is among them
    if hasattr(openmp, "omp_set_num_threads"):
        openmp.omp_set_num_threads(1)
    else:  # a torch without OpenMP: its own pool is process-wide anyway
        torch.set_num_threads(1)


def on_own_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread of its own that then exits, its exception raised here. The engine loads and builds its
    model so: the OpenMP team a thread's parallel kernels start lives until that thread exits, and a team
    left on the caller's thread beside the scheduler thread's makes libgomp (managing more threads than
    CPUs) throttle its workers' spin, so every parallel region of a decode step sleeps and wakes them
    (docs/BENCHMARKS.md section 41)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            error.append(exc)

    worker = threading.Thread(target=run, name="hicache-build")
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return result[0]
