"""The rank front (docs/DESIGN.md, "engine"): the engine front's side of a multi-rank deployment (tp_size x
pp_size > 1), the `Runtime` that `Engine` uses in place of the single-rank scheduler thread.

It starts this node's ranks (launch.py), waits until every rank has joined and built its
scheduler, then sends requests, cancels and control commands to rank 0 and pumps rank 0's events back
to the engine. The pump also watches the ranks: if one exits, or reports a failure (a divergence
found by the checker, a crash), every in-flight request fails with the reason, the remaining ranks are
killed, and the engine is marked failed; nothing waits forever on a rank that is gone.
"""

from __future__ import annotations

import itertools
import logging
import queue
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from hicache.config import EngineConfig
from hicache.engine.base import check_usable
from hicache.engine.commands import Command
from hicache.engine.launch import LocalRanks
from hicache.engine.rank_worker import RankFailure
from hicache.errors import UserError
from hicache.scheduler.request import Request, RequestEvent

logger = logging.getLogger(__name__)

A = TypeVar("A")
T = TypeVar("T")

POLL_S = 0.05  # how often the pump looks at the ranks' liveness while no message arrives
FAILURE_GRACE_S = 1.0  # after a first failure, how long to collect the other ranks' reports
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 30.0


def _exit_reason(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"rank {rank} exited with code {code}"


class RankRuntime:
    """Satisfies runtime.base.Runtime over this node's rank processes (or torchrun rank 0's thread)."""

    def __init__(
        self, cfg: EngineConfig, dispatch: Callable[[RequestEvent], None], on_failure: Callable[[str], None]
    ) -> None:
        self._dispatch = dispatch
        self._on_failure = on_failure
        self._controls: dict[int, Future] = {}
        self._control_ids = itertools.count()
        self._lock = threading.Lock()
        self._running = self._waiting = self._received = self._posted = 0
        self._failed: str | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self.ranks = LocalRanks(cfg)
        try:
            self._await_ready()
        except BaseException:
            self.ranks.kill()
            raise
        self._pump = threading.Thread(target=self._pump_loop, name="hicache-rank-pump", daemon=True)
        self._pump.start()
        logger.info(
            "%d ranks ready (tp %d x pp %d x cp %d)", cfg.parallel.world_size, cfg.parallel.tp_size,
            cfg.parallel.pp_size, cfg.parallel.cp_size,
        )  # fmt: skip

    def _await_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                message = self.ranks.outbox.get(timeout=POLL_S)
            except queue.Empty:
                if self.ranks.exited():
                    raise RuntimeError(f"ranks failed to start: {self._reason([], self.ranks.exited())}") from None
                continue
            if message[0] == "ready":
                return
            if message[0] == "fatal":
                reports = [message[1], *self._more_reports()]
                user_errors = [r for r in reports if r.error == UserError.__name__]
                if user_errors:  # bad configuration found where it is used (e.g. a storage directory)
                    raise UserError(user_errors[0].message)
                raise RuntimeError(f"ranks failed to start: {self._reason(reports, self.ranks.exited())}")
        raise RuntimeError(f"ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")

    # ---- engine side ---------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        with self._lock:
            check_usable(self._failed, self._stopping)
            self._posted += 1
            self.ranks.inbox.put(("request", req))

    def cancel(self, rid: int) -> None:
        if self._failed is None and not self._stopping:
            self.ranks.inbox.put(("cancel", rid))

    def control(self, command: Command[A, T]) -> T:
        fut: Future[Any] = Future()  # rank 0 combines the answers: what comes back is the command's T
        with self._lock:
            check_usable(self._failed, self._stopping)
            control_id = next(self._control_ids)
            self._controls[control_id] = fut
            self.ranks.inbox.put(("control", control_id, command.name))
        return fut.result()

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return self._waiting + self._posted - self._received

    def shutdown(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            if self._failed is None:
                self.ranks.inbox.put(("shutdown",))
        # The pump delivers the last events (every request aborted) and returns when rank 0 stops.
        if not self._stopped.wait(SHUTDOWN_TIMEOUT_S):
            logger.error("ranks did not stop within %.0f s", SHUTDOWN_TIMEOUT_S)
        self.ranks.join(SHUTDOWN_TIMEOUT_S)
        self._fail_controls("the engine is shut down")

    # ---- the pump ------------------------------------------------------------------------------

    def _pump_loop(self) -> None:
        try:
            while True:
                try:
                    message = self.ranks.outbox.get(timeout=POLL_S)
                except queue.Empty:
                    exited = self.ranks.exited()
                    if exited and not self._stopping:
                        self._fail(self._reason(self._more_reports(), exited))
                        return
                    if exited and len(exited) == len(self.ranks.processes) and self._stopping:
                        return
                    continue
                kind = message[0]
                if kind == "events":
                    _, events, self._running, self._waiting, self._received = message
                    for event in events:
                        self._dispatch(event)
                elif kind == "control":
                    _, control_id, ok, value = message
                    fut = self._controls.pop(control_id)
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(RuntimeError(value))
                elif kind == "fatal":
                    time.sleep(FAILURE_GRACE_S / 2)  # the other ranks' reports and exits arrive meanwhile
                    self._fail(self._reason([message[1], *self._more_reports()], self.ranks.exited()))
                    return
                elif kind == "stopped":
                    return
        finally:
            self._stopped.set()

    def _more_reports(self) -> list[RankFailure]:
        """Failure reports that arrive within the grace period (other ranks fail as a consequence)."""
        reports = []
        deadline = time.monotonic() + FAILURE_GRACE_S
        while time.monotonic() < deadline:
            try:
                message = self.ranks.outbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if message[0] == "fatal":
                reports.append(message[1])
        return reports

    @staticmethod
    def _reason(reports: list[RankFailure], exited: list[tuple[int, int]]) -> str:
        """The cause, not its consequences: a rank's own failure (e.g. a divergence) before a rank
        that vanished without a word (killed), before peers that only lost their connection."""
        causes = [r for r in reports if not r.consequence]
        if causes:
            return causes[0].describe()
        reported = {r.rank for r in reports}
        silent = [(rank, code) for rank, code in exited if rank not in reported]
        if silent:
            return _exit_reason(*silent[0])
        if reports:
            return reports[0].describe()
        return _exit_reason(*exited[0])

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._failed = reason
        self.ranks.kill()
        self._fail_controls(reason.splitlines()[0])
        self._on_failure(reason)

    def _fail_controls(self, message: str) -> None:
        controls, self._controls = self._controls, {}
        for fut in controls.values():
            fut.set_exception(RuntimeError(message))
