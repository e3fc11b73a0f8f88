"""Virtual time for the capacity simulator (docs/DESIGN.md, "capacity simulator"): a clock, and links
that stand where the host tier's copy threads stand (hicache/cache/controller.py, `Worker`).

A link finishes its operations in order, each `latency + bytes / bandwidth` after the later of its
submission and the previous one's end, and runs an operation (the real, tiny copy between the
simulator's one-row pools) only when the clock passes its end: until then its ACK is not ready, its
node stays locked, exactly as a slow copy leaves it in a real engine. Nothing here decides anything:
the tiers' own code does, on the schedule the cost model sets.
"""

from __future__ import annotations

import logging
from collections import deque

from hicache.cache import TransferOp

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
        nbytes = op.pages * self.page_bytes
        self._free_at = max(self._free_at, self.clock.now) + self.latency_s + nbytes / self.bandwidth
        self.bytes_moved += nbytes
        self._queue.append((self._free_at, op))
        return op

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
