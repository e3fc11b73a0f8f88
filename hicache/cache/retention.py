"""Retention hints (docs/DESIGN.md, "retention hints"): a request's `priority` and `retention_seconds`, as
the radix tree keeps them on its nodes and lets them lapse.

A node's effective priority is the highest a request that inserted or hit it asked for, for as long
as that request asked (`retention_seconds` past the use; no limit when it gave none); after that it is
0, plain LRU. Eviction in every in-memory tier takes the lowest effective priority first, least
recently used within one priority, so without hints the order is exactly the LRU it always was.

Time is the arrival clock: the engine stamps each request with its arrival on its own monotonic clock
(`Retention.since`, carried to every rank inside the request), and the tree's "now" is the latest
arrival it has seen. Every rank sees the same requests in the same order, so every rank lets the same
retention lapse at the same eviction: reading each rank's own clock at eviction would let two ranks
straddle a lapse and evict differently. The cost: while no request arrives, time stands still for
retention, so a hint can outlive its seconds by as long as the server sees no new request (it never
pins: a retained node is still evicted once nothing of lower priority is left).

Lapsing is lazy but exact: the `RetentionTimeline` keeps every node whose retention can lapse in a heap
by its end, and each eviction call first lapses every node whose end has passed (re-offering it to the
eviction candidates at priority 0), so a lapsed node competes on recency from that call on. Its cost
is O(log n) per hint set, as the candidates' own heaps.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Iterable

from hicache.cache.kv_events import DEVICE
from hicache.cache.radix_lru import LRUCandidates
from hicache.cache.tree_node import TreeNode

MAX_PRIORITY = 2**31 - 1
_MIN_COMPACT = 64  # entries below which the timeline is never compacted


@dataclass(frozen=True)
class Retention:
    """One request's hint. `priority`: 0 (plain LRU) or higher, evicted later; `seconds`: how long after
    its last use by this request a node keeps the priority (None: until it is evicted); `since`: the
    request's arrival on the engine's clock (set by the engine)."""

    priority: int = 0
    seconds: float | None = None
    since: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [0, {MAX_PRIORITY}], got {self.priority}")
        if self.seconds is not None and not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"retention_seconds must be a finite number >= 0, got {self.seconds}")

    @property
    def hinted(self) -> bool:
        return self.priority > 0


NO_RETENTION = Retention()


@dataclass
class RetentionStats:
    """What retention did on one rank's tree. The held pages are a snapshot (a gauge), the rest counters."""

    held_device_pages: int = 0  # device pages of nodes whose priority is above 0 now
    held_host_pages: int = 0  # host pages of host-only nodes whose priority is above 0 now
    deferred_device_evictions: int = 0  # device evictions that took another node where LRU took a retained one
    deferred_host_evictions: int = 0  # the same for host-only nodes
    evicted_retained_device_pages: int = 0  # taken from the device while still retained (pressure won)
    evicted_retained_host_pages: int = 0  # freed from the host while still retained
    lapsed_nodes: int = 0  # nodes whose retention ran out and fell back to plain LRU


class RetentionTimeline:
    """The nodes whose retention can lapse, by when; see the module docstring."""

    __slots__ = ("_heap", "_compact_at", "now", "stats")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, TreeNode]] = []
        self._compact_at = _MIN_COMPACT
        self.now = 0.0  # the latest arrival seen
        self.stats = RetentionStats()

    def clear(self) -> None:
        self._heap = []
        self._compact_at = _MIN_COMPACT

    def effective(self, node: TreeNode) -> int:
        """The node's priority now (0 once its retention has passed, lapsed or not yet)."""
        return node.priority if node.retain_until > self.now else 0

    def remaining(self, node: TreeNode) -> float:
        """Seconds of retention the node has left (0: none; inf: until evicted): what a store that keeps
        no priorities takes as a time credit (StoragePuts)."""
        return node.retain_until - self.now if self.effective(node) else 0.0

    def touch_path(self, nodes: Iterable[TreeNode], retention: Retention) -> None:
        """A request matched or inserted `nodes` (the tree offers the candidates among them afterwards, as
        for any touch). The clock moves on to its arrival; with a hint, each node keeps the higher of its
        effective priority and the hint's, the later end on a tie."""
        self.now = max(self.now, retention.since)  # never back: an earlier arrival may be matched later
        if not retention.hinted:
            return
        until = math.inf if retention.seconds is None else self.now + retention.seconds
        for node in nodes:
            current = self.effective(node)
            if retention.priority > current or (retention.priority == current and until > node.retain_until):
                node.priority, node.retain_until = retention.priority, until
                self.track(node)

    def track(self, node: TreeNode) -> None:
        """`node` holds a retention that can lapse (a touch, or a split's copy)."""
        if node.priority and node.retain_until != math.inf:
            heapq.heappush(self._heap, (node.retain_until, node.id, node))
            if len(self._heap) > self._compact_at:
                self._compact()

    def lapse(self, *candidates: LRUCandidates) -> None:
        """Before an eviction: every node whose retention ended by now drops to priority 0 and is offered
        again to the eviction `candidates`, so it competes on recency from this eviction on."""
        heap = self._heap
        while heap and heap[0][0] <= self.now:
            until, _, node = heapq.heappop(heap)
            if until == node.retain_until and node.priority:
                node.priority, node.retain_until = 0, math.inf
                if node.on_device or node.host_pages is not None:  # still in the tree
                    self.stats.lapsed_nodes += 1
                    for kind in candidates:
                        kind.offer(node)

    def evicted(self, node: TreeNode, pages: int, tier: str) -> None:
        """`pages` of `node` leave `tier` (kv_events.py's DEVICE or HOST): counted if still retained."""
        if self.effective(node):
            if tier == DEVICE:
                self.stats.evicted_retained_device_pages += pages
            else:
                self.stats.evicted_retained_host_pages += pages

    def snapshot(self, nodes: Iterable[TreeNode], deferred: tuple[int, int]) -> RetentionStats:
        """The counters, with the pages retained now by tier (a walk of `nodes`: for a metrics scrape)
        and the (device, host) evictions `deferred` by priority (radix_lru.py counts them)."""
        held_device = held_host = 0
        for node in nodes:
            if self.effective(node):
                if node.device_pages is not None:
                    held_device += len(node.device_pages)
                elif node.host_pages is not None:
                    held_host += len(node.host_pages)
        return dataclasses.replace(
            self.stats, held_device_pages=held_device, held_host_pages=held_host,
            deferred_device_evictions=deferred[0], deferred_host_evictions=deferred[1],
        )  # fmt: skip

    def _compact(self) -> None:
        """Drop entries whose node was renewed or has left the tree; O(1) per push, amortised (as in
        radix_lru.py)."""
        self._heap = [
            e for e in self._heap
            if e[0] == e[2].retain_until and e[2].priority and (e[2].on_device or e[2].host_pages is not None)
        ]  # fmt: skip
        heapq.heapify(self._heap)
        self._compact_at = max(2 * len(self._heap), _MIN_COMPACT)
