"""The radix tree's eviction candidates, least recently used first, kept across calls (radix.py).

Device eviction takes unlocked device nodes with no device-resident child; host eviction takes
unlocked host-only leaves; both in (last_access, id) order, so every rank picks the same nodes. Building
a heap of every node on each eviction call made a call O(tree): a decode step that needs one page
paid for the whole tree. Instead each kind keeps one heap across calls, and the tree `offer`s a node
whenever it may have become a candidate or a candidate's recency changed. Entries are checked when
popped: one whose node was touched since (its last_access moved on) or is no longer a candidate is
dropped, so `pop` returns the least recent current candidate: the order the full rebuild gave.

NOTE (invariant): every current candidate has an entry carrying its current last_access. So every
change that can make a node a candidate (unlock, a child leaving the device or the tree, a new node,
a node going host-only) or change a candidate's last_access (a match or insert touching it) offers
the node; changes that end candidacy need nothing (the entry goes stale). Recency is a logical clock
that only grows, so a stale entry can never look current again.
"""

from __future__ import annotations

import heapq
from typing import Callable

from hicache.cache.tree_node import TreeNode

_MIN_COMPACT = 64  # entries below which the heap is never compacted


class LRUCandidates:
    __slots__ = ("_eligible", "_heap", "_compact_at")

    def __init__(self, eligible: Callable[[TreeNode], bool]) -> None:
        self._eligible = eligible
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._compact_at = _MIN_COMPACT

    def offer(self, node: TreeNode) -> None:
        """`node` may be a candidate now, or was touched while one."""
        if self._eligible(node):
            heapq.heappush(self._heap, (node.last_access, node.id, node))
            if len(self._heap) > self._compact_at:
                self._compact()

    def pop(self) -> TreeNode | None:
        """The least recently used current candidate, taken out; None when there is none."""
        heap = self._heap
        while heap:
            last_access, _, node = heapq.heappop(heap)
            if last_access == node.last_access and self._eligible(node):
                return node
        return None

    def clear(self) -> None:
        self._heap = []
        self._compact_at = _MIN_COMPACT

    def _compact(self) -> None:
        """Drop stale and duplicate entries. Runs only once the heap has grown to twice what was left
        the last time, so its O(heap) cost is O(1) per offer, amortised."""
        current = {n.id: (t, n.id, n) for t, _, n in self._heap if t == n.last_access and self._eligible(n)}
        self._heap = list(current.values())
        heapq.heapify(self._heap)
        self._compact_at = max(2 * len(self._heap), _MIN_COMPACT)
