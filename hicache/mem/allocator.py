"""Page-granular allocation of logical KV slots.

Slot x belongs to page x // page_size. Everything above the pools (tree, scheduler, requests) speaks
logical pages and slots; only pools translate them into memory rows.
"""

from __future__ import annotations

import torch


class PageAllocator:
    """A free list of page ids 0..num_pages-1. Allocation is all-or-nothing and lowest-id first, so two
    ranks that issue the same sequence of allocations and frees hand out the same pages."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0:
            raise ValueError("a pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        return pages

    def free(self, pages: list[int]) -> None:
        if not pages:
            return
        self._free.extend(sorted(pages, reverse=True))
        # Keep lowest-first order: merge is cheap relative to a forward pass and keeps allocation
        # deterministic regardless of free order.
        self._free.sort(reverse=True)
        if len(self._free) > self.num_pages:
            raise RuntimeError("page freed twice: the free list is larger than the pool")

    def slots(self, pages: list[int], num_tokens: int | None = None) -> torch.Tensor:
        """Logical slots of the first `num_tokens` tokens stored in `pages` (all of them by default)."""
        if not pages:
            return torch.empty(0, dtype=torch.int64)
        p = self.page_size
        base = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * p
        slots = (base + torch.arange(p, dtype=torch.int64)).reshape(-1)
        return slots if num_tokens is None else slots[:num_tokens]
