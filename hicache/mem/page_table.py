"""A sequence's page table (docs/DESIGN.md, "memory pools"): its logical pages in order, and the logical
slots they hold as one int64 tensor on the pool's device, kept as the pages change.

A step's batch needs each sequence's slots (`hicache/model/batch.py`). Built from the page list every
step, that is O(context) per request per step: at 64 requests of 100K tokens, 87 of the 108 ms a step
cost the scheduler (docs/BENCHMARKS.md section 19). Kept here, the slots of tokens [0, end) are a view,
and a step that allocates a page writes that page's slots alone. The tensor grows by doubling, so
appending a page costs O(1) amortized however long the sequence.
"""

from __future__ import annotations

from typing import Sequence

import torch


def page_slots(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """The logical slots of `pages`, in order: page q holds slots [q * page_size, (q + 1) * page_size)."""
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    base = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * page_size
    return (base + torch.arange(page_size, dtype=torch.int64)).reshape(-1)


class PageTable:
    """The pages of one sequence and their slots. `pages` is read-only to callers: change it through
    `append`, `replace` and `clear`, which keep the slots in step."""

    def __init__(self, page_size: int, device: torch.device = torch.device("cpu")) -> None:
        self.page_size = page_size
        self.device = device
        self.pages: list[int] = []
        self._slots = torch.empty(0, dtype=torch.int64, device=device)  # room for more: only a prefix is valid

    @property
    def num_slots(self) -> int:
        return len(self.pages) * self.page_size

    def slots(self, end: int | None = None) -> torch.Tensor:
        """The slots of tokens [0, end) (of every page by default), a view of the table: a later
        `replace` writes through it (the same tokens' KV, held by other pages). ValueError past the pages."""
        end = self.num_slots if end is None else end
        if not 0 <= end <= self.num_slots:
            raise ValueError(f"slots of {end} tokens: the table's {len(self.pages)} pages hold {self.num_slots}")
        return self._slots[:end]

    def append(self, pages: Sequence[int]) -> None:
        """`pages` follow the table's."""
        if not pages:
            return
        start = self.num_slots
        stop = start + len(pages) * self.page_size
        if stop > self._slots.shape[0]:
            grown = torch.empty(max(stop, 2 * self._slots.shape[0]), dtype=torch.int64, device=self.device)
            grown[:start] = self._slots[:start]
            self._slots = grown
        self._slots[start:stop] = page_slots(pages, self.page_size).to(self.device)
        self.pages.extend(pages)

    def replace(self, pages: Sequence[int]) -> None:
        """The table's first len(pages) pages become `pages` (the tree's pages for the same tokens)."""
        if len(pages) > len(self.pages):
            raise ValueError(f"{len(pages)} pages replace a table of {len(self.pages)}")
        if list(pages) == self.pages[: len(pages)]:
            return  # the usual case (the tree had none of them first, or the handle holds the tree's): a C compare
        self._slots[: len(pages) * self.page_size] = page_slots(pages, self.page_size).to(self.device)
        self.pages[: len(pages)] = pages

    def clear(self) -> None:
        """No pages (the slots' memory is given back)."""
        self.pages = []
        self._slots = torch.empty(0, dtype=torch.int64, device=self.device)
