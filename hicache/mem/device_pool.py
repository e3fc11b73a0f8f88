"""Device KV pool: per-layer buffers of token rows, indexed by logical slot.

Only this class (and the host pool's copy boundary) maps slots to memory. At one rank a logical slot
is its row. With pages sharded over N ranks (hicache/parallel/placement.py) each rank's buffers hold only
the pages it owns, `num_pages` local pages (local page 0 its padding page); a write keeps the slots
this rank owns and translates them to local rows, and the attention backend reads other ranks' pages
through an all-gather of local pages (`pages_of_layer`).

A hybrid model's sliding-window layers (`sliding_layers`) keep their rows in pages of their own
(`sliding`, hicache/mem/sliding_pool.py): their buffers are that pool's size, and their slots and pages
are translated through its page map here, so callers go on speaking full slots and pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.mem.allocator import PageAllocator
from hicache.mem.kv_layout import KVLayout
from hicache.mem.sliding_pool import SlidingPages


@dataclass(frozen=True)
class OwnedSlots:
    """Which of a list of logical slots this rank holds (`index` into the list; None: all) and at what
    local rows."""

    index: torch.Tensor | None
    rows: torch.Tensor


class DeviceKVPool:
    def __init__(
        self,
        layout: KVLayout,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        shards: int = 1,
        shard_rank: int = 0,
        gather_pages: int | None = None,
        sliding_layers: frozenset[int] = frozenset(),
        sliding_pages: int = 0,
        sliding_window: int = 0,
    ) -> None:
        """`num_pages`: this rank's pages; `shards`, `shard_rank`: the sharding of pages (1, 0: none);
        `gather_pages`: pages per owner class one layer's gather of sharded pages may hold (its scratch
        buffers' size; None: a whole layer of the logical pool). `sliding_layers`: the layers whose rows
        live in `sliding_pages` pages of their own, attending over `sliding_window` tokens (none: no
        sliding pool)."""
        self.layout = layout
        self.num_layers = num_layers
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.allocator = PageAllocator(num_pages, page_size, shards)
        self.placement = self.allocator.placement
        self.shard_rank = shard_rank
        self.local_pages = num_pages
        self.gather_pages = gather_pages
        self.capacity_tokens = self.allocator.num_pages * page_size  # logical, over every shard
        self.sliding_layers = sliding_layers
        self.sliding = (
            SlidingPages(num_pages, sliding_pages, page_size, sliding_window, device) if sliding_layers else None
        )
        if self.sliding is not None and shards > 1:
            raise ValueError("sliding-window pages are not sharded")
        self.buffers = [torch.zeros(self._rows_of_layer(layer), layout.row_numel, dtype=dtype, device=device)
                        for layer in range(num_layers)]  # fmt: skip

    def _rows_of_layer(self, layer: int) -> int:
        if self.sliding is not None and layer in self.sliding_layers:
            return self.sliding.rows_allocated
        return self.local_pages * self.page_size

    def free(self, pages: list[int]) -> None:
        """Give pages back: their full rows, and their window KV's sliding pages where they hold some."""
        self.allocator.free(pages)
        if self.sliding is not None:
            self.sliding.release(pages)

    def whole_rows(self, pages: list[int]) -> bool:
        """Whether every page of `pages` holds every layer's rows (a sliding layer's: its window KV)."""
        return self.sliding is None or all(self.sliding.held(pages))

    def layer_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Where (local) rows `rows` are in layer `layer`'s buffer: themselves, or a sliding layer's rows."""
        if self.sliding is not None and layer in self.sliding_layers:
            return self.sliding.rows(rows)
        return rows

    def layer_pages(self, layer: int, pages: list[int]) -> list[int]:
        """Where (local) pages `pages` are in `pages_of_layer(layer)`: themselves, or a sliding layer's."""
        if self.sliding is not None and layer in self.sliding_layers:
            return self.sliding.page_ids(pages)
        return pages

    @property
    def sharded(self) -> bool:
        return self.placement.shards > 1

    @property
    def bytes_per_token(self) -> int:
        """Bytes of a token's rows over every layer, the sliding layers' included (a whole-row copy's)."""
        return self.layout.row_numel * self.num_layers * self.buffers[0].element_size()

    def resident_bytes(self) -> int:
        """Bytes of KV this rank holds for allocated pages (its own class only when sharded): the full
        layers' rows of every allocated page, the sliding layers' of the pages holding window KV."""
        used = self.allocator.used_by_class()[self.shard_rank]
        row = self.layout.row_numel * self.buffers[0].element_size() * self.page_size
        if self.sliding is None:
            return used * row * self.num_layers
        sliding = len(self.sliding_layers)
        return used * row * (self.num_layers - sliding) + self.sliding.used_pages * row * sliding

    def pages_of_layer(self, layer: int) -> torch.Tensor:
        """Layer `layer` as a [local pages, page_size * row] view: the unit tier copies move (a sliding
        layer's: its own pages, `layer_pages`)."""
        return self.buffers[layer].view(-1, self.page_size * self.layout.row_numel)

    def owned(self, slots: torch.Tensor) -> OwnedSlots:
        """The slots of `slots` this rank stores, and their local rows (all of them when unsharded)."""
        if not self.sharded:
            return OwnedSlots(None, slots)
        index = (self.placement.owners(slots) == self.shard_rank).nonzero().flatten()
        return OwnedSlots(index, self.placement.local_rows(slots[index]))

    def write_rows(self, layer: int, where: OwnedSlots, rows: torch.Tensor) -> None:
        """Store packed rows [len(slots), width] of the slots `where` was made from (this rank's only)
        in a row's first `width` columns: attention's components lead the row, and state beside them
        (written by the layer owning it) follows."""
        mine = rows if where.index is None else rows.index_select(0, where.index)
        dst, at = self.write_target(layer, where, rows.shape[1])
        dst.index_copy_(0, at, mine.to(self.dtype))

    def write_target(self, layer: int, where: OwnedSlots, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where `write_rows` stores rows `width` wide of the slots `where` was made from: the layer's
        buffer (its first `width` columns) and the rows of it, dst.index_copy_(0, rows, ...)."""
        dst = self.buffers[layer] if width == self.layout.row_numel else self.buffers[layer][:, :width]
        return dst, self.layer_rows(layer, where.rows)

    def read_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Packed rows of slots this rank holds."""
        if self.sharded:
            slots = self.placement.local_rows(slots)
        return self.buffers[layer].index_select(0, self.layer_rows(layer, slots))

    def write(self, layer: int, slots: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Write the given components of rows `slots` (this rank's only); a layout with state beside the
        KV is written by several callers (attention writes K and V, the layer owning the state writes it)."""
        if len(parts) == len(self.layout.components):
            self.write_rows(layer, self.owned(slots), self.layout.pack(parts))
            return
        for name, value in parts.items():
            offset, numel = self.layout.span(name)
            self.write_columns(layer, slots, offset, value.reshape(value.shape[0], numel))

    def write_columns(self, layer: int, slots: torch.Tensor, offset: int, rows: torch.Tensor) -> None:
        """Store rows [len(slots), n] in columns [offset, offset + n) of rows `slots` (this rank's only): a
        component, or state a layer keeps in columns the layout names for other layers (a hybrid model's
        recurrent layer in attention's K and V columns, hicache/model/families/hybrid.py)."""
        where = self.owned(slots)
        mine = rows if where.index is None else rows.index_select(0, where.index)
        columns = self.buffers[layer][:, offset : offset + rows.shape[1]]
        columns.index_copy_(0, self.layer_rows(layer, where.rows), mine.to(self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layout.unpack(self.read_rows(layer, slots))
