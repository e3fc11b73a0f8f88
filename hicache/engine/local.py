"""The local runtime (docs/DESIGN.md, "engine"): at one rank, the scheduler runs on a background thread of the
caller's process. The engine front hands it requests, cancels and control commands and receives events
through a callback. (With several ranks, rank_front.py plays this role over rank processes.)"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

import torch

from hicache.engine.base import check_usable
from hicache.engine.commands import Command
from hicache.parallel.threads import use_threads
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.request import FinishReason, Request, RequestEvent
from hicache.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

R = TypeVar("R")
A = TypeVar("A")

IDLE_POLL_S = 0.002  # while requests wait on a storage prefetch and nothing runs


class LocalRuntime:
    """Satisfies runtime.base.Runtime with the one scheduler on a thread; `call` runs any function there."""

    def __init__(self, scheduler: Scheduler, dispatch: Callable[[RequestEvent], None], threads: int) -> None:
        self.scheduler = scheduler
        self._threads = threads
        self._dispatch = dispatch
        self._inbox: list[Request] = []
        self._control: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._names = [ParallelContext().suffix]  # the one rank's name, as a command's combine expects
        self._cancels: list[int] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="hicache-scheduler", daemon=True)
        self._thread.start()

    # ---- front side ----------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        with self._wake:
            check_usable(None, self._stopped)
            self._inbox.append(req)
            self._wake.notify()

    def cancel(self, rid: int) -> None:
        with self._wake:
            self._cancels.append(rid)
            self._wake.notify()

    def control(self, command: Command[A, R]) -> R:
        """Run a command on the scheduler thread between two steps and return its (one rank's) answer."""
        return self.call(lambda: command.combine([command.run(self.scheduler)], self._names))

    def call(self, fn: Callable[[], R]) -> R:
        """Run `fn` on the scheduler thread between two steps and return its result."""
        fut: Future[R] = Future()
        with self._wake:
            check_usable(None, self._stopped)
            self._control.append((fn, fut))
            self._wake.notify()
        return fut.result()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    def shutdown(self) -> None:
        with self._wake:
            if self._stopped:
                return
            self._stopped = True
            self._wake.notify()
        self._thread.join()
        self.scheduler.close()
        self.scheduler.cache.shutdown()
        self.scheduler.checker.close()

    # ---- scheduler thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        use_threads(self._threads)
        scheduler = self.scheduler
        while True:
            with self._wake:
                while not (self._stopped or self._inbox or self._control or self._cancels or scheduler.has_work):
                    self._wake.wait()
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
                control, self._control = self._control, []
                cancels, self._cancels = self._cancels, []
            for req in inbox:
                scheduler.add(req)
            for rid in cancels:
                scheduler.abort(rid)
            for fn, fut in control:
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            try:
                events = scheduler.step()
            except Exception as exc:
                logger.exception("scheduler step failed; failing every in-flight request")
                events = scheduler.abort_all(FinishReason.ERROR, f"internal error: {exc}")
            for event in events:
                self._dispatch(event)
            if scheduler.has_work and not scheduler.running:
                # Requests wait on something asynchronous (a storage prefetch, a P/D transfer): poll
                # gently, so the transfer threads get the CPU, and wake at once for anything new.
                with self._wake:
                    self._wake.wait(timeout=IDLE_POLL_S)
        for event in scheduler.abort_all(FinishReason.ERROR, "the engine was shut down"):
            self._dispatch(event)
        with self._wake:
            control, self._control = self._control, []
        for _, fut in control:
            fut.set_exception(RuntimeError("the engine is shut down"))
