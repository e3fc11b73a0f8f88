"""Asynchronous transfers between tiers: device -> host backups, host -> device loads (layer by layer),
host <-> storage puts and reads.

Copies run on worker threads (on CUDA the copies themselves are issued on a side stream by the same
threads). Each operation has a completion event; backups and loads complete into ordered ACK queues that
the scheduler consumes at its checks, through the rank-agreement interface, so every rank applies the
same completions at the same logical point. Workers are supervised: an exception fails the operation
(its KV is treated as a miss), is logged, and the worker keeps serving; a worker thread that dies is
restarted on the next submission. Every wait on an operation is bounded (`--hicache-transfer-timeout`):
a copy or storage call that hangs fails the step that waits on it with a TransferTimeout instead of
stalling every request behind it forever.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from hicache.parallel.threads import serial_kernels

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 60.0


class TransferTimeout(RuntimeError):
    """An asynchronous copy or storage call did not finish within its deadline."""


class CopyStream:
    """Where tier copies run. On CUDA: a side stream that first waits for the work queued on the
    compute stream when the copy was issued (so a backup never reads KV a forward pass is still
    writing), and whose completion is awaited on the worker thread before the op's event is set (so
    an ACK means the bytes have landed). On the CPU, copies are synchronous and this is a no-op."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fence(self) -> object | None:
        """Call when issuing a copy, on the scheduler thread."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def run(self, fence: object | None, copy: Callable[[], None]) -> None:
        """Call on the worker thread: run `copy` after the fence and wait until it has completed."""
        if self._stream is None:
            copy()
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(fence)  # type: ignore[arg-type]
            copy()
        self._stream.synchronize()


@dataclass(eq=False)
class TransferOp:
    """One unit of asynchronous work with its completion state."""

    kind: str
    run: Callable[["TransferOp"], None]
    payload: object = None
    # What the op moves (which node, which pages), equal on every rank that issued the same op: ranks
    # agree on how many ops to consume and then compare these, so a count over different ops is caught.
    ident: int = 0
    pages: int = 0  # KV pages it moves (a virtual-time link, hicache/sim/links.py, costs it by these)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S  # set by the worker it is submitted to

    @property
    def failed(self) -> bool:
        return self.error is not None

    def wait(self, milestone: threading.Event | None = None) -> None:
        """Until the op has completed (or reached `milestone`, e.g. one layer of a load, or failed
        before it); TransferTimeout after timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        event = milestone or self.done
        while not event.wait(timeout=0.05):
            if self.done.is_set():
                return  # failed (or finished) without setting the milestone
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{self.kind} transfer did not finish within {self.timeout_s:g} s")


class SupervisedWorker:
    """A FIFO worker thread. `debug_delay_s` delays each completion by a random amount (fault injection
    for tests and for users debugging their own deployment)."""

    def __init__(
        self, name: str, debug_delay_s: float = 0.0, seed: int = 0, timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._queue: queue.Queue[TransferOp | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._delay = debug_delay_s
        self._rng = random.Random(seed)
        self.restarts = 0
        self.failures = 0

    def submit(self, op: TransferOp) -> TransferOp:
        op.timeout_s = self.timeout_s
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                if self._thread is not None:
                    self.restarts += 1
                    logger.error("transfer worker %s died; restarting it", self.name)
                self._thread = threading.Thread(target=self._loop, name=f"hicache-{self.name}", daemon=True)
                self._thread.start()
        self._queue.put(op)
        return op

    def _loop(self) -> None:
        serial_kernels()
        while True:
            op = self._queue.get()
            if op is None:
                return
            try:
                op.run(op)
            except Exception as exc:  # noqa: BLE001 - the op becomes a miss, the worker goes on
                op.error = exc
                self.failures += 1
                logger.exception("%s transfer failed; its pages are treated as a miss", op.kind)
            if self._delay:
                time.sleep(self._rng.uniform(0, self._delay))
            op.done.set()

    def stop(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._queue.put(None)
                self._thread.join(timeout=10)
            self._thread = None


class Worker(Protocol):
    """Where a tier's operations run: a `SupervisedWorker` thread, or a link that completes them at
    virtual times (the capacity simulator, hicache/sim/links.py)."""

    restarts: int
    failures: int

    def submit(self, op: TransferOp) -> TransferOp: ...

    def stop(self) -> None: ...


# name, debug delay, seed, timeout: a SupervisedWorker's arguments
WorkerFactory = Callable[[str, float, int, float], Worker]
# What a tier reads the time from (seconds; time.monotonic, or the simulator's virtual clock)
Clock = Callable[[], float]


class AckQueue:
    """Operations in issue order. The scheduler consumes an agreed-on number from the front."""

    def __init__(self) -> None:
        self._ops: deque[TransferOp] = deque()

    def push(self, op: TransferOp) -> None:
        self._ops.append(op)

    def ready(self) -> int:
        """How many leading operations have completed (this rank's view)."""
        n = 0
        for op in self._ops:
            if not op.done.is_set():
                break
            n += 1
        return n

    def pop(self, n: int) -> list[TransferOp]:
        """The first n operations, waiting for any still running here (another rank's view decided
        that n are done; this rank's copies must finish before their results are applied)."""
        ops = [self._ops.popleft() for _ in range(n)]
        for op in ops:
            op.wait()
        return ops

    def last(self) -> TransferOp | None:
        """The operation pushed last (a caller that just issued one holds on to it)."""
        return self._ops[-1] if self._ops else None

    def running(self) -> list[TransferOp]:
        """Operations issued and not yet completed on this rank."""
        return [op for op in self._ops if not op.done.is_set()]

    def drain(self) -> list[TransferOp]:
        return self.pop(len(self._ops))

    def __len__(self) -> int:
        return len(self._ops)
