"""Page-granular allocation of logical KV slots, one free list per owner class.

Slot x belongs to page x // page_size. Everything above the pools (tree, scheduler, requests) speaks
logical pages and slots; only pools translate them into memory rows (hicache/parallel/placement.py).

With pages sharded over N ranks (context parallelism, MLA over attention TP), logical page q is owned
by rank q mod N, so the pages of one owner form a class and each class has its own free list. Every
shard rank keeps the same allocator (the whole logical state, every class), so ranks that apply the
same operations hand out the same page ids: what a page's owner stores physically is decided at the
copy boundary, not here. Callers choose the classes (a prefix's pages cycle through them from its
rotation base, hicache/cache/page_budget.py); at N = 1 there is one class and this is a plain free list.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from hicache.mem.page_table import page_slots
from hicache.parallel.placement import Placement


class PageAllocator:
    """Free lists of logical page ids, one per owner class. `num_pages` is the pages each rank's pool
    has (its physical size); with N > 1 its local page 0 is the rank's padding page, so N * (num_pages
    - 1) logical pages are allocatable. Allocation is all-or-nothing and lowest id first within a
    class, so two ranks that issue the same sequence of allocations and frees hand out the same pages."""

    def __init__(self, num_pages: int, page_size: int, shards: int = 1) -> None:
        if num_pages <= 0:
            raise ValueError("a pool needs at least one page")
        self.placement = Placement(shards, page_size)
        if shards > 1 and num_pages < 2:
            raise ValueError("a sharded pool needs a padding page and at least one more per rank")
        self.local_pages = num_pages
        self.page_size = page_size
        self.num_classes = shards
        # Stacks: pop() gives the lowest id.
        self._free: list[list[int]] = [
            self.placement.class_pages(c, num_pages)[::-1] for c in range(shards)
        ]  # fmt: skip
        self.class_capacity = len(self._free[0])
        self.num_pages = self.class_capacity * shards  # allocatable logical pages

    @property
    def free_pages(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    def free_by_class(self) -> list[int]:
        return [len(f) for f in self._free]

    def used_by_class(self) -> list[int]:
        return [self.class_capacity - len(f) for f in self._free]

    def class_of(self, page: int) -> int:
        return self.placement.owner(page)

    def alloc(self, n: int, classes: Sequence[int] | None = None) -> list[int] | None:
        """n pages, page i from owner class classes[i] (None: one class, or, sharded, a cycle from the
        class with the most free pages); None if some class has too few free pages."""
        if classes is None:
            classes = self.placement.rotation_classes(self.emptiest_class(), 0, n)
        if len(classes) != n:
            raise ValueError(f"{n} pages asked for with {len(classes)} classes")
        wanted = Counter(classes)
        if any(k > len(self._free[c]) for c, k in wanted.items()):
            return None
        return [self._free[c].pop() for c in classes]

    def emptiest_class(self) -> int:
        """The class with the most free pages (the lowest on a tie): where a new prefix starts."""
        free = self.free_by_class()
        return free.index(max(free))

    def free(self, pages: list[int]) -> None:
        if not pages:
            return
        touched = set()
        for page in pages:
            c = self.class_of(page)
            self._free[c].append(page)
            touched.add(c)
        for c in touched:
            # Keep lowest-first order: cheap next to a forward pass, and allocation stays
            # deterministic whatever order pages come back in.
            self._free[c].sort(reverse=True)
            if len(self._free[c]) > self.class_capacity:
                raise RuntimeError("page freed twice: the free list is larger than the pool")

    def slots(self, pages: list[int], num_tokens: int | None = None) -> torch.Tensor:
        """Logical slots of the first `num_tokens` tokens stored in `pages` (all of them by default)."""
        slots = page_slots(pages, self.page_size)
        return slots if num_tokens is None else slots[:num_tokens]
