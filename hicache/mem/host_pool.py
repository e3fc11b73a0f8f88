"""Host KV pool: the second tier, in host memory, in pages of the device pool's page size.

Layouts (`--hicache-mem-layout`):
- `page_first`: [pages, layers, page_size, row]. A page's KV for every layer is one contiguous span, so
  a page moves to and from storage as one buffer, with no gather.
- `layer_first`: [layers, pages * page_size, row], the device pool's own shape: a backup or load is one
  strided copy per layer.

Copies between tiers go through `backup` (device -> host) and `load_layer` (host -> device, one layer at
a time, so a forward pass can start on layer 0 while later layers are still loading). On CUDA the buffer
is pinned so the copies can run asynchronously on a side stream.
"""

from __future__ import annotations

import torch

from hicache.mem.allocator import PageAllocator
from hicache.mem.device_pool import DeviceKVPool

LAYOUTS = ("page_first", "layer_first")


class HostKVPool:
    def __init__(self, device_pool: DeviceKVPool, num_pages: int, layout: str = "page_first") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown host layout {layout!r}")
        self.layout = layout
        self.page_size = device_pool.page_size
        self.num_layers = device_pool.num_layers
        self.row = device_pool.layout.row_numel
        self.dtype = device_pool.dtype
        self.allocator = PageAllocator(num_pages, self.page_size)
        pin = device_pool.device.type == "cuda"
        shape = (
            (num_pages, self.num_layers, self.page_size, self.row)
            if layout == "page_first"
            else (self.num_layers, num_pages * self.page_size, self.row)
        )
        self.buffer = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        self.capacity_tokens = num_pages * self.page_size

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.page_size * self.row * self.buffer.element_size()

    def _layer_view(self, layer: int, host_pages: torch.Tensor) -> torch.Tensor:
        """[n_pages * page_size, row] rows of `layer` for the given host pages (a copy)."""
        if self.layout == "page_first":
            return self.buffer[host_pages, layer].reshape(-1, self.row)
        slots = (host_pages.unsqueeze(1) * self.page_size + torch.arange(self.page_size)).reshape(-1)
        return self.buffer[layer].index_select(0, slots)

    def backup(self, device: DeviceKVPool, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy whole pages device -> host, every layer."""
        dslots = device.allocator.slots(device_pages).to(device.device)
        hp = torch.tensor(host_pages, dtype=torch.int64)
        n = len(host_pages)
        for layer in range(self.num_layers):
            rows = device.buffers[layer].index_select(0, dslots).to("cpu", non_blocking=True)
            if self.layout == "page_first":
                self.buffer[:, layer].index_copy_(0, hp, rows.view(n, self.page_size, self.row))
            else:
                hslots = self.allocator.slots(host_pages)
                self.buffer[layer].index_copy_(0, hslots, rows)

    def load_layer(self, device: DeviceKVPool, layer: int, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy one layer of whole pages host -> device."""
        rows = self._layer_view(layer, torch.tensor(host_pages, dtype=torch.int64))
        dslots = device.allocator.slots(device_pages).to(device.device)
        device.buffers[layer].index_copy_(0, dslots, rows.to(device.device, non_blocking=True))

    def page_payload(self, host_page: int) -> bytes:
        """One page, every layer, as bytes in page_first order (the storage object's payload)."""
        if self.layout == "page_first":
            page = self.buffer[host_page]
        else:
            s = host_page * self.page_size
            page = self.buffer[:, s : s + self.page_size]
        return page.contiguous().view(torch.uint8).numpy().tobytes()

    def page_view(self, host_page: int) -> memoryview:
        """A writable byte view of one page (page_first only), so storage reads land in place."""
        assert self.layout == "page_first"
        return memoryview(self.buffer[host_page].view(torch.uint8).reshape(-1).numpy())

    def write_page(self, host_page: int, payload: bytes | memoryview) -> None:
        """Inverse of `page_payload`."""
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype)
        src = src.view(self.num_layers, self.page_size, self.row)
        if self.layout == "page_first":
            self.buffer[host_page].copy_(src)
        else:
            s = host_page * self.page_size
            self.buffer[:, s : s + self.page_size].copy_(src)
