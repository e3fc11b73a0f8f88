"""Device KV pool: per-layer buffers of token rows, indexed by logical slot.

At one rank a logical slot is its row. Only this class (and the host pool's copy boundary) maps slots
to memory, so a sharded placement (CP) changes this file, not the tree or the scheduler.
"""

from __future__ import annotations

import torch

from hicache.mem.allocator import PageAllocator
from hicache.mem.kv_layout import KVLayout


class DeviceKVPool:
    def __init__(
        self,
        layout: KVLayout,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.num_layers = num_layers
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.allocator = PageAllocator(num_pages, page_size)
        self.capacity_tokens = num_pages * page_size
        self.buffers = [
            torch.zeros(self.capacity_tokens, layout.row_numel, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    @property
    def bytes_per_token(self) -> int:
        return self.layout.row_numel * self.num_layers * self.buffers[0].element_size()

    def pages_of_layer(self, layer: int) -> torch.Tensor:
        """Layer `layer` as a [pages, page_size * row] view: the unit tier copies move."""
        return self.buffers[layer].view(self.allocator.num_pages, -1)

    def write(self, layer: int, slots: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Write the given components of rows `slots`; a layout with state beside the KV is written
        by several callers (attention writes K and V, the layer owning the state writes it)."""
        if len(parts) == len(self.layout.components):
            self.buffers[layer].index_copy_(0, slots, self.layout.pack(parts).to(self.dtype))
            return
        for name, value in parts.items():
            offset, numel = self.layout.span(name)
            rows = value.reshape(value.shape[0], numel).to(self.dtype)
            self.buffers[layer][:, offset : offset + numel].index_copy_(0, slots, rows)

    def read(self, layer: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layout.unpack(self.buffers[layer].index_select(0, slots))
