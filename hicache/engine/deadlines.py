"""Request deadlines (`--request-timeout`), kept by the engine front (docs/DESIGN.md, "engine").

The front, not the schedulers, watches the clock: with several ranks the schedulers run in lockstep
and must take the same decisions, so a deadline becomes an ordinary cancel that rank 0 broadcasts.
The client gets its error at the deadline even if the scheduler is stuck in a step; what the request
held is released when the scheduler takes the cancel in.
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Callable


class DeadlineWatch:
    """Calls `expired(rid)` once for each request still open at its deadline, from a thread of its own."""

    def __init__(self, timeout_s: float, expired: Callable[[int], None]) -> None:
        self.timeout_s = timeout_s
        self._expired = expired
        self._heap: list[tuple[float, int]] = []
        self._open: set[int] = set()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="hicache-deadlines", daemon=True)
        self._thread.start()

    def start(self, rid: int) -> None:
        with self._wake:
            heapq.heappush(self._heap, (time.monotonic() + self.timeout_s, rid))
            self._open.add(rid)
            self._wake.notify()

    def finished(self, rid: int) -> None:
        with self._wake:
            self._open.discard(rid)  # its heap entry is skipped when it comes up

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._wake.wait(timeout=self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                _, rid = heapq.heappop(self._heap)
                if rid not in self._open:
                    continue
                self._open.discard(rid)
            self._expired(rid)
