"""The rank worker (docs/DESIGN.md, "engine"): one rank's process. It joins the job (the process groups of its
ParallelContext, each with a finite timeout, --dist-timeout, so a rank that never arrives makes its
peers fail instead of waiting forever), builds this rank's scheduler (its layers, its KV heads, its own
radix tree, pools and transfer workers) and runs the SPMD loop.

Each iteration, rank 0 takes what the engine front sent (requests, cancels, control commands, shutdown)
and broadcasts it on the world gloo group, so every rank applies the same operations in the same
order; then every rank runs one scheduler step. Rank 0 reports the step's events to the front; answers
to control commands are gathered to rank 0 and combined. When idle, rank 0 still broadcasts an empty
message every HEARTBEAT_S, so no peer waits in a collective anywhere near the group timeout, and a
dead front is noticed.

Any exception ends the rank: with ranks in lockstep there is no safe way for one to skip a step. It is
reported on the shared outbox (with whether it is the cause or a consequence of another rank's
failure), and the front fails the engine.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hicache.config import EngineConfig
from hicache.engine.build import build_scheduler, load_engine_model
from hicache.engine.commands import COMMANDS
from hicache.engine.interfaces import choose_gloo_interface
from hicache.errors import UserError
from hicache.parallel.divergence import RankDivergenceError
from hicache.parallel.parallel import Mesh, ParallelContext
from hicache.scheduler.request import FinishReason, RequestEvent
from hicache.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
WAITING_POLL_S = 0.002  # requests wait on a prefetch or a transfer and nothing runs: poll gently


@dataclass(frozen=True)
class RankFailure:
    """Why a rank stopped, as reported to the front."""

    rank: int
    name: str  # tpXofY_ppZofW
    error: str  # the exception's class name
    message: str
    consequence: bool  # caused by another rank's failure (a lost connection), not the cause

    def describe(self) -> str:
        return f"rank {self.rank} ({self.name}) failed: {self.error}: {self.message}"


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to join the job."""

    rank: int
    local_rank: int
    world_size: int
    init_method: str  # tcp://host:port, or env:// under torchrun
    threads: int  # torch intra-op threads: this node's cores shared among its ranks
    log_level: int
    parent_pid: int | None = None  # spawned ranks leave when the front's process is gone


def init_distributed(spec: RankSpec, cfg: EngineConfig) -> ParallelContext:
    """Join the job and build this rank's groups (ParallelContext.create)."""
    par = cfg.parallel
    device = cfg.resolved_device()
    if device.type == "cuda":
        torch.cuda.set_device(spec.local_rank)
    timeout = timedelta(seconds=par.dist_timeout)
    compute = "nccl" if device.type == "cuda" else "gloo"
    choose_gloo_interface(spec.init_method)  # every group is gloo: ParallelContext adds CPU groups on CUDA too
    dist.init_process_group(
        compute, init_method=spec.init_method, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )
    pctx = ParallelContext.create(spec.rank, Mesh(pp=par.pp_size, cp=par.cp_size, tp=par.tp_size), compute, timeout)
    logger.info("rank %d joined as %s", spec.rank, pctx.suffix)
    return pctx


def is_consequence(exc: BaseException) -> bool:
    """True for errors that another rank's failure causes here (a peer that closed its connections or
    stopped answering), which are not worth reporting as the cause."""
    if isinstance(exc, RankDivergenceError):
        return False
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out", "gloo"))


class RankWorker:
    def __init__(self, pctx: ParallelContext, scheduler: Scheduler, inbox: Any, outbox: Any, parent_pid: int | None):
        self.pctx = pctx
        self.scheduler = scheduler
        self.inbox = inbox  # rank 0 only
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.received = 0  # requests taken from the front, for its count of waiting requests
        self._reported = (0, 0, 0)

    @property
    def is_leader(self) -> bool:
        return self.pctx.rank == 0

    def run(self) -> None:
        while True:
            messages = self._broadcast(self._take_inputs() if self.is_leader else None)
            if not self._apply(messages):
                break
            self._report(self.scheduler.step())
        self._report(self.scheduler.abort_all(FinishReason.ERROR, "the engine was shut down"))

    # ---- rank 0: inputs from the front -----------------------------------------------------------

    def _take_inputs(self) -> list[tuple]:
        s = self.scheduler
        if s.running:
            timeout = 0.0
        elif s.has_work:  # waiting on something asynchronous (a storage prefetch, a P/D transfer)
            timeout = WAITING_POLL_S
        else:
            timeout = HEARTBEAT_S
        messages = []
        try:
            messages.append(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            while True:
                messages.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        if not messages and self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.error("the engine front's process is gone; shutting the ranks down")
            messages.append(("shutdown",))
        return messages

    def _broadcast(self, messages: list[tuple] | None) -> list[tuple]:
        box = [messages]
        dist.broadcast_object_list(box, src=0, group=self.pctx.world_group)
        return box[0]

    # ---- every rank: the same operations in the same order ---------------------------------------

    def _apply(self, messages: list[tuple]) -> bool:
        s = self.scheduler
        running = True
        for message in messages:
            kind = message[0]
            if kind == "request":
                s.add(message[1])
                self.received += 1
            elif kind == "cancel":
                s.abort(message[1])
            elif kind == "control":
                self._control(message[1], message[2])
            elif kind == "shutdown":
                running = False
        return running

    def _control(self, control_id: int, name: str) -> None:
        command = COMMANDS[name]
        try:
            answer: tuple[bool, Any] = (True, command.run(self.scheduler))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            answer = (False, f"{type(exc).__name__}: {exc}")
        answers: list[Any] = [None] * self.pctx.world_size
        mine = (self.pctx.suffix, answer)
        dist.gather_object(mine, answers if self.is_leader else None, dst=0, group=self.pctx.world_group)
        if not self.is_leader:
            return
        failed = [f"{name}: {value}" for name, (ok, value) in answers if not ok]
        if failed:
            self.outbox.put(("control", control_id, False, "; ".join(failed)))
        else:
            value = command.combine([value for _, (_, value) in answers], [rank for rank, _ in answers])
            self.outbox.put(("control", control_id, True, value))

    def _report(self, events: list[RequestEvent]) -> None:
        if not self.is_leader:
            return
        s = self.scheduler
        status = (len(s.running), len(s.waiting), self.received)
        if events or status != self._reported:
            self.outbox.put(("events", events, *status))
            self._reported = status


def rank_main(spec: RankSpec, cfg: EngineConfig, inbox: Any, outbox: Any) -> None:
    """Entry point of a rank process (and of rank 0's thread under torchrun)."""
    if spec.parent_pid is not None:  # a process the front spawned
        logging.basicConfig(
            level=spec.log_level, format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s"
        )
        # Ctrl-C reaches the whole process group; the front decides how the ranks stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)
    torch.set_grad_enabled(False)
    pctx = ParallelContext()
    scheduler = None
    try:
        pctx = init_distributed(spec, cfg)
        cfg, loaded = load_engine_model(cfg)
        scheduler = build_scheduler(cfg, loaded, pctx)
        del loaded
        dist.barrier(group=pctx.world_group)
        if spec.rank == 0:
            outbox.put(("ready",))
        RankWorker(pctx, scheduler, inbox, outbox, spec.parent_pid).run()
        scheduler.close()
        scheduler.cache.shutdown()
        scheduler.checker.close()
        dist.barrier(group=pctx.world_group)
    except BaseException as exc:
        consequence = is_consequence(exc)
        if isinstance(exc, RankDivergenceError):
            # Every rank finds the same divergence; rank 0 shows the whole report, the others its first line.
            logger.error(
                "rank %d (%s): %s", spec.rank, pctx.suffix, str(exc) if spec.rank == 0 else str(exc).splitlines()[0]
            )
        elif consequence:
            logger.warning("rank %d (%s) stops: %s", spec.rank, pctx.suffix, exc)
        elif isinstance(exc, UserError):
            logger.error("rank %d: %s", spec.rank, exc)
        else:
            logger.exception("rank %d (%s) failed", spec.rank, pctx.suffix)
        if outbox is not None:
            outbox.put(("fatal", RankFailure(spec.rank, pctx.suffix, type(exc).__name__, str(exc), consequence)))
        if scheduler is not None:
            scheduler.close()
            scheduler.checker.close()
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if spec.rank == 0:
        outbox.put(("stopped",))
