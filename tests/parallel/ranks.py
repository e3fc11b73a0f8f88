"""Real rank processes for the multi-rank unit tests: spawned, joined over gloo on loopback, each
reporting one outcome, so a test asserts on every rank's view of the same run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from hicache.engine.launch import free_port
from hicache.parallel.parallel import ParallelContext

RankTarget = Callable[[int, str, Any], None]  # (rank, init method, results queue), a module-level function


def outcomes_of(target: RankTarget, world_size: int, timeout_s: float = 120) -> dict[int, Any]:
    """Run `target` on `world_size` spawned ranks; the outcome each reported, by rank. Fails if a rank
    reports nothing in time or exits non-zero."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(rank, init, results)) for rank in range(world_size)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return got


def report(rank: int, outcome: Any, pctx: ParallelContext, results: Any) -> None:
    """A rank's last act: hand its outcome to the test, then leave together (no rank tears down its
    connections while a peer may still be talking to it)."""
    results.put((rank, outcome))
    dist.barrier(group=pctx.world_group)
    dist.destroy_process_group()
