"""The radix tree's eviction candidates, least recently used first, kept across calls (radix.py).

Device eviction takes unlocked device nodes with no device-resident child; host eviction takes
unlocked host-only leaves; both in (priority, last_access, id) order, so every rank picks the same nodes
(priority: a request's retention hint, retention.py, docs/DESIGN.md, "retention hints"; 0 for every node
without hints, which leaves plain LRU). Building
a heap of every node on each eviction call made a call O(tree): a decode step that needs one page
paid for the whole tree. Instead each kind keeps one heap across calls, and the tree `offer`s a node
whenever it may have become a candidate or a candidate's recency changed. Entries are checked when
popped: one whose node was touched since (its last_access or priority moved on) or is no longer a
candidate is dropped, so `pop` returns the least recent current candidate of the lowest priority: the
order the full rebuild gave.

NOTE (invariant): every current candidate has an entry carrying its current (priority, last_access).
So every change that can make a node a candidate (unlock, a child leaving the device or the tree, a
new node, a node going host-only) or change a candidate's key (a match or insert touching it, its
retention lapsing) offers the node; changes that end candidacy need nothing (the entry goes stale).
Recency is a logical clock that only grows, and a priority only rises with a touch (which moves the
clock), so a stale entry can never look current again.

Retained candidates (priority above 0) also sit in a second heap by recency alone, so a pop can tell
when plain LRU would have taken a retained node instead (`deferred`, a metric); without hints it stays
empty and costs one test per pop.
"""

from __future__ import annotations

import heapq
from typing import Callable

from hicache.cache.tree_node import TreeNode

_MIN_COMPACT = 64  # entries below which the heap is never compacted


class LRUCandidates:
    __slots__ = ("_eligible", "_heap", "_retained", "_compact_at", "deferred")

    def __init__(self, eligible: Callable[[TreeNode], bool]) -> None:
        self._eligible = eligible
        self._heap: list[tuple[int, int, int, TreeNode]] = []
        self._retained: list[tuple[int, int, TreeNode]] = []  # retained candidates, by recency alone
        self._compact_at = _MIN_COMPACT
        self.deferred = 0  # pops that took a node where plain LRU would have taken a retained one

    def offer(self, node: TreeNode) -> None:
        """`node` may be a candidate now, or was touched while one."""
        if self._eligible(node):
            heapq.heappush(self._heap, (node.priority, node.last_access, node.id, node))
            if node.priority:
                heapq.heappush(self._retained, (node.last_access, node.id, node))
            if len(self._heap) + len(self._retained) > self._compact_at:
                self._compact()

    def pop(self) -> TreeNode | None:
        """The least recently used current candidate of the lowest priority, taken out; None when there
        is none."""
        heap = self._heap
        while heap:
            priority, last_access, _, node = heapq.heappop(heap)
            if last_access == node.last_access and priority == node.priority and self._eligible(node):
                if self._retained:
                    self._count_deferral(node)
                return node
        return None

    def _count_deferral(self, taken: TreeNode) -> None:
        """Plain LRU would have taken the least recent retained candidate, if older than `taken` (which
        pop order makes one of lower priority)."""
        retained = self._retained
        while retained:
            last_access, _, node = retained[0]
            if node is not taken and last_access == node.last_access and node.priority and self._eligible(node):
                break
            heapq.heappop(retained)  # stale, or `taken` itself, which leaves this tier now
        if retained and retained[0][0] < taken.last_access:
            self.deferred += 1

    def clear(self) -> None:
        self._heap = []
        self._retained = []
        self._compact_at = _MIN_COMPACT

    def _compact(self) -> None:
        """Drop stale and duplicate entries. Runs only once the heap has grown to twice what was left
        the last time, so its O(heap) cost is O(1) per offer, amortised."""
        current = {
            n.id: (p, t, n.id, n)
            for p, t, _, n in self._heap
            if t == n.last_access and p == n.priority and self._eligible(n)
        }
        self._heap = list(current.values())
        heapq.heapify(self._heap)
        retained = {n.id: (t, n.id, n) for t, _, n in self._retained if t == n.last_access and n.priority}
        self._retained = [entry for entry in retained.values() if self._eligible(entry[2])]
        heapq.heapify(self._retained)
        self._compact_at = max(2 * (len(self._heap) + len(self._retained)), _MIN_COMPACT)
