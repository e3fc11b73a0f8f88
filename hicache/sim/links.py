"""Virtual time for the capacity simulator (docs/DESIGN.md, "capacity simulator"): a clock, and links
that stand where the tiers' worker threads stand (hicache/cache/controller.py, `Worker`): the host
tier's copies, and the storage tier's queries, reads and puts.

A link finishes its operations in order, each its cost (`latency + bytes / bandwidth`) after the later
of its submission and the previous one's end, and runs an operation (the real, tiny copy between the
simulator's one-row pools, or the real store call on their pages) only when the clock passes its end:
until then its ACK is not ready, its node stays locked, exactly as a slow copy leaves it in a real
engine. An operation a tier waits for before the clock reaches it (admission stopping a storage read
that has not begun, which then reads nothing) runs at once. Nothing here decides anything: the tiers'
own code does, on the schedule the cost model sets.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from hicache.cache import TransferOp
from hicache.sim.cost import Storage

logger = logging.getLogger(__name__)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class VirtualLink:
    """One direction of a link (`bandwidth` bytes/s, `latency_s` per operation) carrying operations
    of `page_bytes` a page (the modelled KV's page, not the simulator's pools')."""

    def __init__(self, name: str, clock: VirtualClock, bandwidth: float, latency_s: float, page_bytes: int) -> None:
        self.name = name
        self.clock = clock
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        self.page_bytes = page_bytes
        self.bytes_moved = 0
        self.restarts = 0  # what a `Worker` reports; a virtual link never dies
        self.failures = 0
        self._free_at = 0.0
        self._queue: deque[tuple[float, TransferOp]] = deque()

    def submit(self, op: TransferOp) -> TransferOp:
        self._free_at = max(self._free_at, self.clock.now) + self.cost_s(op)
        op.done = _DoneOnWait(self, op)
        self._queue.append((self._free_at, op))
        return op

    def cost_s(self, op: TransferOp) -> float:
        """How long `op` holds the link (counting the bytes it moves)."""
        nbytes = op.pages * self.page_bytes
        self.bytes_moved += nbytes
        return self.latency_s + nbytes / self.bandwidth

    def moved(self) -> dict[str, int]:
        """Bytes moved, by direction."""
        return {self.name: self.bytes_moved}

    @property
    def next_completion(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def run_until(self, t: float) -> None:
        """Complete every operation that ends by `t`."""
        while self._queue and self._queue[0][0] <= t:
            self._complete(self._queue.popleft()[1])

    def finish_all(self) -> float:
        """Complete everything queued; when the last of it ends (the clock's now if nothing was queued)."""
        end = self._queue[-1][0] if self._queue else self.clock.now
        self.run_until(end)
        return end

    def complete_now(self, op: TransferOp) -> None:
        """Run `op` ahead of its time: a tier is waiting for it. The link stays busy for its cost."""
        for k, (_, queued) in enumerate(self._queue):
            if queued is op:
                del self._queue[k]
                self._complete(op)
                return

    def _complete(self, op: TransferOp) -> None:
        try:
            op.run(op)
        except Exception as exc:  # noqa: BLE001 - as a SupervisedWorker: the op becomes a miss
            op.error = exc
            self.failures += 1
            logger.exception("%s transfer failed in the simulator", op.kind)
        op.done.set()

    def stop(self) -> None:
        self.finish_all()


class StorageLink(VirtualLink):
    """The storage tier's one worker: existence queries cost a call's latency, reads and puts the
    latency and their bytes at the store's read or write bandwidth."""

    def __init__(self, clock: VirtualClock, storage: Storage, page_bytes: int) -> None:
        super().__init__("storage", clock, storage.read_bandwidth, storage.latency_s, page_bytes)
        self.write_bandwidth = storage.write_bandwidth
        self.bytes_written = 0

    def cost_s(self, op: TransferOp) -> float:
        nbytes = op.pages * self.page_bytes
        if op.kind == "storage_put":
            self.bytes_written += nbytes
            return self.latency_s + nbytes / self.write_bandwidth
        self.bytes_moved += nbytes  # a read (a query moves no page)
        return self.latency_s + nbytes / self.bandwidth

    def moved(self) -> dict[str, int]:
        return {"storage->host": self.bytes_moved, "host->storage": self.bytes_written}


class _DoneOnWait(threading.Event):
    """An operation's completion on a virtual link: waiting for it before the clock reaches its end
    runs it now (a real wait would block until the worker got to it; a virtual one cannot)."""

    def __init__(self, link: VirtualLink, op: TransferOp) -> None:
        super().__init__()
        self.link = link
        self.op = op

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set():
            self.link.complete_now(self.op)
        return super().wait(timeout)
