"""Launch (docs/DESIGN.md, "engine"): where each rank's process comes from (spawned by the engine front, by a
follower node, or by torchrun) and the rendezvous address it joins (rank_worker.py joins it).

Launch modes:
- one node (default): the front spawns tp*pp processes that rendezvous on tcp://127.0.0.1:<free port>
  (or --dist-init-addr);
- several nodes (--nnodes, --node-rank, --dist-init-addr, as in SGLang): node 0 runs the front and
  its share of the ranks, every other node runs `run_follower_node` (its ranks only);
- torchrun: each process is one rank (env://); rank 0 hosts the front and runs its rank on a thread,
  the others run `run_torchrun_rank`.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
from typing import Any, Callable

import torch.multiprocessing as mp

from hicache.config import EngineConfig
from hicache.engine.rank_worker import RankSpec, rank_main
from hicache.parallel.threads import cpu_threads
from hicache.errors import UserError

logger = logging.getLogger(__name__)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# Below Linux's default ephemeral range (32768-60999), from which the kernel picks both bind(0)'s
# port and every outgoing connection's: a port from that range could be taken in the seconds before
# its server binds it (a P/D server of a full test run found its port in use).
PORT_RANGE = (10000, 32767)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a rendezvous or a server. The one definition for the
    runtime, the benchmark's servers and the tests."""
    while True:
        port = random.SystemRandom().randint(*PORT_RANGE)  # not the seedable global generator
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or any env:// launcher) started it, else None."""
    if all(v in os.environ for v in TORCHRUN_VARS):
        return int(os.environ["RANK"])
    return None


def _torchrun_spec(log_level: int) -> RankSpec:
    """This process's rank as torchrun's environment describes it (env:// rendezvous)."""
    rank = torchrun_rank()
    assert rank is not None
    threads = cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return RankSpec(rank, int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), "env://", threads, log_level)


def _init_method(cfg: EngineConfig) -> str:
    addr = cfg.parallel.dist_init_addr
    return f"tcp://{addr}" if addr else f"tcp://127.0.0.1:{free_port()}"


class LocalRanks:
    """This node's ranks, with the queues to rank 0 (inbox) and from every rank (outbox): processes
    spawned here, or under torchrun rank 0's thread in this process."""

    def __init__(self, cfg: EngineConfig) -> None:
        par = cfg.parallel
        log_level = logging.getLogger().getEffectiveLevel()
        self.processes: list[Any] = []
        self.thread: threading.Thread | None = None
        if torchrun_rank() is not None:
            world = int(os.environ["WORLD_SIZE"])
            if world != par.world_size:
                raise UserError(
                    f"torchrun started {world} processes but --tp-size x --pp-size x --cp-size is {par.world_size}"
                )
            self.inbox: Any = queue.Queue()
            self.outbox: Any = queue.Queue()
            spec = _torchrun_spec(log_level)
            self.thread = threading.Thread(target=rank_main, args=(spec, cfg, self.inbox, self.outbox), daemon=True)
            self.thread.start()
            return
        ctx = mp.get_context("spawn")
        self.inbox = ctx.Queue()
        self.outbox = ctx.Queue()
        self.processes = _spawn(ctx, cfg, _init_method(cfg), self.inbox, self.outbox, log_level)

    def exited(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every rank that is no longer running (the thread's as code 1)."""
        gone = [(rank, p.exitcode) for rank, p in self.processes if p.exitcode is not None]
        if self.thread is not None and not self.thread.is_alive():
            gone.append((0, 1))
        return gone

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` for the ranks to end, then terminate what is left."""
        for _, p in self.processes:
            p.join(timeout)
        for rank, p in self.processes:
            if p.is_alive():
                logger.warning("rank %d did not stop; terminating it", rank)
                p.kill()
                p.join(5)
        if self.thread is not None:
            self.thread.join(timeout)

    def kill(self) -> None:
        for _, p in self.processes:
            if p.is_alive():
                p.kill()
        for _, p in self.processes:
            p.join(5)


def _spawn(
    ctx: Any, cfg: EngineConfig, init_method: str, inbox: Any, outbox: Any, log_level: int
) -> list[tuple[int, Any]]:
    par = cfg.parallel
    per_node = par.ranks_per_node
    threads = cpu_threads(per_node)
    processes = []
    for local in range(per_node):
        rank = par.node_rank * per_node + local
        spec = RankSpec(rank, local, par.world_size, init_method, threads, log_level, parent_pid=os.getpid())
        process = ctx.Process(
            target=rank_main,
            args=(spec, cfg, inbox if rank == 0 else None, outbox),
            name=f"hicache-rank{rank}",
            daemon=True,
        )
        process.start()
        processes.append((rank, process))
    return processes


def run_follower_node(cfg: EngineConfig) -> int:
    """--node-rank > 0: run this node's ranks until node 0 shuts the job down; the exit status is 1
    if any of them failed."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    log_level = logging.getLogger().getEffectiveLevel()
    processes = _spawn(ctx, cfg, _init_method(cfg), None, outbox, log_level)
    logger.info("node %d: ranks %s running", cfg.parallel.node_rank, [r for r, _ in processes])
    for _, p in processes:
        p.join()
    failed = [(rank, p.exitcode) for rank, p in processes if p.exitcode]
    for rank, code in failed:
        logger.error("rank %d exited with code %s", rank, code)
    return 1 if failed else 0


def run_torchrun_rank(cfg: EngineConfig) -> int:
    """Under torchrun, every process but rank 0 is a bare rank: run it here until shutdown."""
    spec = _torchrun_spec(logging.getLogger().getEffectiveLevel())
    assert spec.rank > 0
    try:
        rank_main(spec, cfg, None, None)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def rank_only_node(cfg: EngineConfig) -> Callable[[], int] | None:
    """For `generate` and `serve`: the function to run instead of the engine front when this process
    only hosts ranks (a node other than node 0, or a torchrun rank other than 0)."""
    rank = torchrun_rank()
    if rank is not None:
        return (lambda: run_torchrun_rank(cfg)) if rank > 0 else None
    if cfg.parallel.node_rank > 0:
        return lambda: run_follower_node(cfg)
    return None
