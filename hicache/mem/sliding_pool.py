"""The sliding-window layers' own pages (docs/DESIGN.md, "Hybrid models"): a hybrid model's sliding layers
need a token's K and V only while some request's window can reach it, so they do not share the full
layers' slots. They keep rows in a smaller pool of their own pages, with their own allocator, and a page
map from each full (logical) page to the sliding page that holds its window KV, -1 where none does.

Everything above the pools still speaks full pages and slots; a sliding layer's reads and writes go through
`rows`, which translates a full slot to its sliding row. A full page whose map entry is -1 is a tombstone
for the sliding layers: its full-attention KV and recurrent-state rows are kept, its window KV is gone. Its
slots translate to the pool's last page, kept zero and never allocated, so a window that reaches before a
sequence's start (masked) reads there; the cache's match rule makes sure no visible key is ever read there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.mem.allocator import PageAllocator


class SlidingPages:
    """`num_pages` sliding pages for a full pool of `full_pages` pages, rows on `device`, for layers that
    attend over the last `window` tokens (the query's own included)."""

    def __init__(self, full_pages: int, num_pages: int, page_size: int, window: int, device: torch.device) -> None:
        if not 0 < num_pages <= full_pages:
            raise ValueError(f"a sliding pool of {num_pages} pages for a full pool of {full_pages}")
        self.page_size = page_size
        self.window = window
        self.allocator = PageAllocator(num_pages, page_size)
        self.num_pages = num_pages
        self.rows_allocated = (num_pages + 1) * page_size  # the last page: where tombstoned slots read
        # The scheduler decides on the CPU copy; the kernels translate through the device's (one tensor on CPU).
        self._map = torch.full((full_pages,), -1, dtype=torch.int64)
        self._device_map = self._map if device.type == "cpu" else self._map.to(device)
        self._nowhere = num_pages

    @property
    def used_pages(self) -> int:
        return self.allocator.used_pages

    def held(self, pages: Sequence[int]) -> list[bool]:
        """Whether each full page's window KV is held."""
        if not pages:
            return []
        return (self._map[torch.tensor(pages, dtype=torch.int64)] >= 0).tolist()

    def attach(self, pages: Sequence[int]) -> None:
        """Give each full page of `pages` a sliding page (the caller made room: `allocator.free_pages`)."""
        if not pages:
            return
        got = self.allocator.alloc(len(pages))
        if got is None:
            raise RuntimeError(f"KV reservation invariant broken: no room for {len(pages)} sliding pages")
        self._set(pages, got)

    def release(self, pages: Sequence[int]) -> int:
        """Free the sliding pages of the full pages `pages` that hold one; the number freed."""
        if not pages:
            return 0
        index = torch.tensor(pages, dtype=torch.int64)
        mapped = self._map[index]
        held = mapped >= 0
        freed = mapped[held].tolist()
        self.allocator.free(freed)
        self._set(index[held].tolist(), [-1] * len(freed))
        return len(freed)

    def adopt(self, pages: Sequence[int], donors: Sequence[int]) -> None:
        """Pages of `pages` whose window KV was freed take the sliding page of the same tokens' page in
        `donors` (computed again, so the same bits), where that one holds one."""
        if not pages:
            return
        mine, theirs = torch.tensor(list(donors), dtype=torch.int64), torch.tensor(list(pages), dtype=torch.int64)
        moves = (self._map[theirs] < 0) & (self._map[mine] >= 0)
        if bool(moves.any()):
            given = self._map[mine[moves]].tolist()
            self._set(theirs[moves].tolist(), given)
            self._set(mine[moves].tolist(), [-1] * len(given))

    def _set(self, pages: Sequence[int], sliding: Sequence[int]) -> None:
        index, values = torch.tensor(pages, dtype=torch.int64), torch.tensor(sliding, dtype=torch.int64)
        self._map[index] = values
        if self._device_map is not self._map:
            self._device_map[index.to(self._device_map.device)] = values.to(self._device_map.device)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The sliding rows of full `slots` (of tombstoned pages: the never-written last page's)."""
        p = self.page_size
        pages = self._device_map[slots // p]
        return torch.where(pages >= 0, pages, self._nowhere) * p + slots % p

    def page_ids(self, pages: Sequence[int]) -> list[int]:
        """The sliding pages of full `pages`, for whole-page copies (every one must be held)."""
        mapped = self._map[torch.tensor(list(pages), dtype=torch.int64)].tolist() if pages else []
        if any(m < 0 for m in mapped):
            raise RuntimeError("a whole-page copy of a page whose window KV was freed")
        return mapped
