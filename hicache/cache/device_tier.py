"""The device tier (docs/DESIGN.md, "tiers"): the device KV pool's pages as the radix tree hands them out.

It allocates device pages (evicting unlocked cache, least recently used first, when the free list is
short), inserts computed pages into the tree (returning a duplicate when another request cached the
same tokens first), and reports what it holds. The tree itself is shared with the host tier, whose
pages live in the same nodes; so is the page budget (page_budget.py) over its pool and tree, which says
which owner class each page comes from when pages are sharded: eviction then repeats until every class
asked for has room. A hybrid model's sliding-window pages (sliding_tier.py) go with the device pages:
every page allocated gets one, every page freed gives its own back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from hicache.cache.page_budget import PageBudget
from hicache.cache.radix import PagesFn, RadixTree, TreeNode
from hicache.cache.retention import NO_RETENTION, Retention
from hicache.cache.sliding_tier import SlidingWindowTier
from hicache.debug.consensus_checker import consensus_checked
from hicache.mem.device_pool import DeviceKVPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inserted:
    pages: list[int]  # the tree's device pages for the key (the caller's, or the ones cached first)
    last_node: TreeNode
    new_nodes: list[TreeNode]
    refused: bool = False  # another rotation base is cached on the path: nothing was inserted


class DeviceTier:
    def __init__(self, pool: DeviceKVPool, on_host_free: PagesFn | None = None, evict: bool = True) -> None:
        """`on_host_free`: where host pages of removed nodes go (the host pool, with a host tier).
        `evict`: False when nothing is cached (radix cache off), so allocation never evicts. With a host
        tier (`on_host_free`), a node's window KV is freed only once it is backed up."""
        self.pool = pool
        self.allocator = pool.allocator
        self.page_size = pool.page_size
        self.tree = RadixTree(
            self.page_size, on_device_free=pool.free, on_host_free=on_host_free,
            num_classes=self.allocator.num_classes,
        )  # fmt: skip
        self.budget = PageBudget(pool, self.tree)
        self._evict = evict
        sliding = pool.sliding
        self.sliding = SlidingWindowTier(sliding, self.tree, on_host_free is not None) if sliding is not None else None

    def available_pages(self) -> int:
        """Pages an allocation can get: free ones plus what eviction can free."""
        return self.allocator.free_pages + self.tree.evictable_pages

    # The pages' ids name their classes (class = id mod N), so the result records those too.
    @consensus_checked(params=("n",), results=("result",))
    def alloc(
        self, n: int, keep_if: Callable[[TreeNode], bool] | None = None, classes: Sequence[int] | None = None
    ) -> list[int]:
        """n device pages, page i of class classes[i] (None: one class), evicting unlocked cache until
        every class asked for has room (`keep_if`: see RadixTree.evict). Callers only ask for what
        admission reserved, so this cannot fail."""
        if classes is None:
            classes = self.budget.classes(self.allocator.emptiest_class(), 0, n)
        while self._evict:
            short = self.budget.short(self.allocator, classes)
            # Eviction frees least recently used pages of any class: repeat until this one has room.
            if short <= 0 or self.tree.evict(short, keep_if=keep_if) == 0:
                break
        pages = self.allocator.alloc(n, classes)
        if pages is None:
            raise RuntimeError("KV reservation invariant broken: an admitted request could not allocate")
        if self.sliding is not None:
            self.sliding.make_room(n, lambda short: self.tree.evict(short, keep_if=keep_if))
            self.sliding.pages.attach(pages)
        return pages

    def sliding_room(self, n: int, promised: int) -> bool:
        """Whether n more pages' window KV fits besides `promised` pages' (always, without a sliding pool)."""
        return self.sliding is None or self.sliding.room(n, promised)

    @consensus_checked(params=("rotation",), results={"refused": "result.refused"})
    def insert(
        self, tokens: Sequence[int], pages: list[int], namespace: str, rotation: int = 0,
        retention: Retention = NO_RETENTION,
    ) -> Inserted:  # fmt: skip
        """Cache `tokens` (a page multiple) computed into `pages` from rotation base `rotation`, with the
        caching request's `retention` hint. Where the tree already had them on the device, its page wins
        and ours goes back to the pool. Refused (the caller keeps its pages) where the cached path has
        another rotation base."""
        res = self.tree.insert(tokens, pages, namespace, rotation, retention)
        if res.refused:
            return Inserted(list(pages), res.last_node, [], refused=True)
        pairs = [(mine, theirs) for mine, theirs in zip(pages, res.pages) if mine != theirs]
        if self.sliding is not None and pairs:
            # The tree's page may be a tombstone this request's page (the same tokens' KV) fills: a request that
            # recomputed them, its hit shrunk, reads its window from them after this.
            self.sliding.pages.adopt([theirs for _, theirs in pairs], [mine for mine, _ in pairs])
        self.pool.free([mine for mine, _ in pairs])
        return Inserted(list(res.pages), res.last_node, res.new_nodes)

    def free(self, pages: list[int]) -> None:
        self.pool.free(pages)

    def evict_all(self) -> None:
        self.tree.evict(self.tree.total_pages)

    def leak_report(self) -> list[str]:
        problems = []
        a = self.allocator
        if a.free_pages != a.num_pages:
            problems.append(f"{a.num_pages - a.free_pages} device pages not freed")
        if self.sliding is not None and self.sliding.pages.used_pages:
            problems.append(f"{self.sliding.pages.used_pages} sliding-window pages not freed")
        if self.tree.locked_nodes():
            problems.append(f"locked nodes: {self.tree.locked_nodes()}")
        return problems

    def usage(self) -> tuple[int, int]:
        """(used, capacity) in tokens."""
        a = self.allocator
        return a.used_pages * a.page_size, a.num_pages * a.page_size
