"""Host KV pool: the second tier, in host memory, in pages of the device pool's page size.

Layouts (`--hicache-mem-layout`):
- `page_first`: [pages, layers, page_size, row]. A page's KV for every layer is one contiguous span, so
  a page moves to and from storage as one buffer, with no gather.
- `layer_first`: [layers, pages * page_size, row], the device pool's own shape: a backup or load is one
  strided copy per layer.

Copies between tiers go through `backup` (device -> host) and `load_layer` (host -> device, one layer at
a time, so a forward pass can start on layer 0 while later layers are still loading). On CUDA the buffer
is pinned so the copies can run asynchronously on a side stream.

With pages sharded over N ranks (hicache/dist/placement.py) the host pool is sharded the same way: a
host page's owner class is that of the device page it backs up (the host tier allocates it so), and
each rank holds, copies and serves only its own pages, about 1/N of the bytes. The copy boundary is
here: callers pass logical page ids, this rank keeps its own (device, host) pairs and translates both
to local pages, so the ranks move distinct shards concurrently through their own paths.
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
        self.allocator = PageAllocator(num_pages, self.page_size, device_pool.placement.shards)
        self.placement = self.allocator.placement
        self.shard_rank = device_pool.shard_rank
        self.local_pages = num_pages
        pin = device_pool.device.type == "cuda"
        shape = (
            (num_pages, self.num_layers, self.page_size, self.row)
            if layout == "page_first"
            else (self.num_layers, num_pages * self.page_size, self.row)
        )
        self.buffer = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        self.capacity_tokens = self.allocator.num_pages * self.page_size  # logical, over every shard

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.page_size * self.row * self.buffer.element_size()

    def _host_pages_of_layer(self, layer: int) -> torch.Tensor:
        """Layer `layer` of every host page as a [pages, page_size * row] view (strided for page_first)."""
        if self.layout == "page_first":
            return self.buffer[:, layer].flatten(1)
        return self.buffer[layer].view(self.local_pages, -1)

    def _copy(self, dst: torch.Tensor, dst_pages: list[int], src: torch.Tensor, src_pages: list[int]) -> None:
        """dst[dst_pages[i]] = src[src_pages[i]] for [pages, page_bytes] views. Runs of consecutive pages
        on both sides (the allocators hand out lowest ids first, so runs are the common case) move in
        one strided copy each: a single pass over the bytes, where a gather then a scatter is two."""
        runs = _runs(dst_pages, src_pages)
        if len(runs) * 4 > len(dst_pages):  # fragmented: two index ops beat many small copies
            d = torch.tensor(dst_pages, dtype=torch.int64, device=dst.device)
            s = torch.tensor(src_pages, dtype=torch.int64, device=src.device)
            dst.index_copy_(0, d, src.index_select(0, s).to(dst.device, non_blocking=True))
            return
        for d0, s0, k in runs:
            dst[d0 : d0 + k].copy_(src[s0 : s0 + k], non_blocking=True)

    def owns(self, host_page: int) -> bool:
        """Whether this rank holds logical host page `host_page`."""
        return self.placement.owner(host_page) == self.shard_rank

    def _local(self, host_page: int) -> int:
        if not self.owns(host_page):
            raise ValueError(f"host page {host_page} belongs to shard rank {self.placement.owner(host_page)}")
        return self.placement.local_page(host_page)

    def _own_pairs(self, device_pages: list[int], host_pages: list[int]) -> tuple[list[int], list[int]]:
        """This rank's (device, host) page pairs as local pages. A pair's pages share an owner class."""
        if self.placement.shards == 1:
            return device_pages, host_pages
        mine = [(d, h) for d, h in zip(device_pages, host_pages) if self.owns(h)]
        assert all(self.placement.owner(d) == self.shard_rank for d, _ in mine), "a page would change owner"
        local = self.placement.local_page
        return [local(d) for d, _ in mine], [local(h) for _, h in mine]

    def backup(self, device: DeviceKVPool, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy whole pages device -> host, every layer (this rank's pairs)."""
        d, h = self._own_pairs(device_pages, host_pages)
        for layer in range(self.num_layers):
            self._copy(self._host_pages_of_layer(layer), h, device.pages_of_layer(layer), d)

    def load_layer(self, device: DeviceKVPool, layer: int, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy one layer of whole pages host -> device (this rank's pairs)."""
        d, h = self._own_pairs(device_pages, host_pages)
        self._copy(device.pages_of_layer(layer), d, self._host_pages_of_layer(layer), h)

    def resident_bytes(self) -> int:
        """Bytes of KV this rank holds for allocated host pages (its own class only when sharded)."""
        return self.allocator.used_by_class()[self.shard_rank] * self.page_bytes

    def page_payload(self, host_page: int) -> bytes:
        """One page, every layer, as bytes in page_first order (the storage object's payload)."""
        host_page = self._local(host_page)
        if self.layout == "page_first":
            page = self.buffer[host_page]
        else:
            s = host_page * self.page_size
            page = self.buffer[:, s : s + self.page_size]
        return page.contiguous().view(torch.uint8).numpy().tobytes()

    def page_view(self, host_page: int) -> memoryview:
        """A writable byte view of one page (page_first only), so storage reads land in place."""
        assert self.layout == "page_first"
        return memoryview(self.buffer[self._local(host_page)].view(torch.uint8).reshape(-1).numpy())

    def write_page(self, host_page: int, payload: bytes | memoryview) -> None:
        """Inverse of `page_payload`."""
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype)
        src = src.view(self.num_layers, self.page_size, self.row)
        host_page = self._local(host_page)
        if self.layout == "page_first":
            self.buffer[host_page].copy_(src)
        else:
            s = host_page * self.page_size
            self.buffer[:, s : s + self.page_size].copy_(src)


def _runs(dst: list[int], src: list[int]) -> list[tuple[int, int, int]]:
    """(dst_start, src_start, length) of maximal runs where both sides advance by one page."""
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst, src):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((d, s, 1))
    return runs
