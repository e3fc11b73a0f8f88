"""The page budget (docs/DESIGN.md, "CP page sharding"): the one part that knows owner classes, which
admission and the device and host tiers ask.

Sharded pages (hicache/parallel/placement.py): page P of a prefix comes from owner class (b + P) mod N,
b the prefix's rotation base, kept on its tree nodes; a new prefix starts on the class with the most
free pages (`new_rotation`); a host copy takes the class of the page it copies (`classes_of`). Room is
counted per class: the tightest class decides, not the total.

Admission promises a READY request the pages it may still need (`reserved_by_class`), and a request is
admitted only if, in every class, they fit the free and evictable pages less what others were promised
(`room`). With pages sharded each layer's attention first gathers the prefix pages of every running
request into a scratch buffer (hicache/model/attention/kv_gather.py) holding at most `capacity` pages per class
(`--cp-gather-tokens`); what a step gathers is, per class, distinct pages of READY requests: tree pages
they hold locked (counted by the tree, `protected_by_class`), pages of their own not shared yet
(`private_by_class`, kept here) and later only pages they were promised. So the request's new pages
must also keep every class's gather within the capacity. Without a capacity the scratch holds a whole
layer of the logical pool and nothing can overflow it. Every input of these decisions (free lists,
evictable and locked pages by class, the tree) is mirrored on every shard rank, so they are pure
functions of mirrored state; the consensus checker records them.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from hicache.cache.radix import RadixTree
from hicache.debug.consensus_checker import consensus_checked
from hicache.mem.allocator import PageAllocator
from hicache.mem.device_pool import DeviceKVPool


class PageBudget:
    def __init__(self, pool: DeviceKVPool, tree: RadixTree) -> None:
        self.allocator = pool.allocator
        self.placement = pool.placement
        self.tree = tree
        self.capacity = pool.gather_pages  # gather pages per owner class; None: the whole pool
        classes = pool.allocator.num_classes
        self.reserved_pages = 0  # promised to READY handles, not yet allocated by them
        self.reserved_by_class = [0] * classes
        self.private_by_class = [0] * classes  # pages READY requests gather that are not the tree's

    # ---- where pages go ------------------------------------------------------------------------

    def classes(self, rotation: int, first: int, n: int) -> list[int]:
        """Owner classes of pages first..first+n-1 of a prefix with rotation base `rotation`."""
        return self.placement.rotation_classes(rotation, first, n)

    def classes_of(self, pages: Sequence[int]) -> list[int]:
        """The owner classes of pages by id (a host copy takes its device page's)."""
        return [self.placement.owner(p) for p in pages]

    @consensus_checked(params=(), results=("result",))
    def new_rotation(self) -> int:
        """Where a new prefix starts: the class with the most free pages (the lowest on a tie)."""
        return self.allocator.emptiest_class()

    @staticmethod
    def short(allocator: PageAllocator, classes: Sequence[int]) -> int:
        """How many pages of `classes` `allocator` lacks, summed over the classes that lack some."""
        free = allocator.free_by_class()
        return sum(max(0, k - free[c]) for c, k in Counter(classes).items())

    # ---- admission -----------------------------------------------------------------------------

    def room(self, rotation: int, first: int, n: int) -> bool:
        """Whether pages first..first+n-1 of a prefix with rotation base `rotation` fit, class by
        class, in the pool and in the gather's scratch."""
        classes = self.classes(rotation, first, n)
        return self.pool_room(classes) and self.gather_fits(classes)

    def pool_room(self, classes: Sequence[int]) -> bool:
        """Whether pages of `classes` fit in each class's free and evictable pages, less what admitted
        requests were promised there."""
        free, evictable = self.allocator.free_by_class(), self.tree.evictable_by_class
        reserved = self.reserved_by_class
        return all(k <= free[c] + evictable[c] - reserved[c] for c, k in Counter(classes).items())

    def gather_fits(self, classes: Sequence[int]) -> bool:
        """Whether new pages of `classes` keep every class's gather within the capacity."""
        if self.capacity is None:
            return True
        wanted = Counter(classes)
        locked, private, reserved = self.tree.protected_by_class, self.private_by_class, self.reserved_by_class
        return all(
            locked[c] + private[c] + reserved[c] + wanted.get(c, 0) <= self.capacity for c in range(len(private))
        )

    def promise(self, rotation: int, first: int, n: int, sign: int) -> None:
        """Count (sign +1) or uncount (-1) pages first..first+n-1 of a request's path as promised."""
        self.reserved_pages += sign * n
        for c in self.classes(rotation, first, n):
            self.reserved_by_class[c] += sign

    def hold(self, rotation: int, first: int, n: int, sign: int) -> None:
        """Pages first..first+n-1 of a READY request's path become (+1) or stop being (-1) its own."""
        for c in self.classes(rotation, first, n):
            self.private_by_class[c] += sign

    def leak_report(self) -> list[str]:
        problems = [f"{self.reserved_pages} pages still reserved"] if self.reserved_pages else []
        if any(self.private_by_class):
            problems.append(f"pages still counted as requests' own: {self.private_by_class}")
        return problems
