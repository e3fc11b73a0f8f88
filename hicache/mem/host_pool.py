"""Host KV pool: the second tier, in host memory, in pages of the device pool's page size.

Layouts (`--hicache-mem-layout`):
- `page_first`: [pages, layers, page_size, row]. A page's KV for every layer is one contiguous span, so
  a page moves to and from storage as one buffer, with no gather.
- `layer_first`: [layers, pages * page_size, row], the device pool's own shape: a backup or load is one
  strided copy per layer.
- `page_unified`: the unified storage layout's order (hicache/storage/unified.py), so a host page splits
  directly into storage objects. MHA: [pages, head groups, layers, K/V, page_size, heads per group,
  head_dim], this rank's head groups and layers, so each (group, layer range) is one contiguous span;
  copies from the device pool pack rows into this order and unpack them on the way back. Any other
  row (MLA's latent: (page, layer, token, dim)) is page_first's shape.

Copies between tiers go through `backup` (device -> host) and `load_layer` (host -> device, one layer at
a time, so a forward pass can start on layer 0 while later layers are still loading). On CUDA the buffer
is pinned so the copies can run asynchronously on a side stream.

With pages sharded over N ranks (hicache/parallel/placement.py) the host pool is sharded the same way: a
host page's owner class is that of the device page it backs up (the host tier allocates it so), and
each rank holds, copies and serves only its own pages, about 1/N of the bytes. The copy boundary is
here: callers pass logical page ids, this rank keeps its own (device, host) pairs and translates both
to local pages, so the ranks move distinct shards concurrently through their own paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.mem.allocator import PageAllocator
from hicache.mem.device_pool import DeviceKVPool

LAYOUTS = ("page_first", "layer_first", "page_unified")


class HostKVPool:
    def __init__(
        self,
        device_pool: DeviceKVPool,
        num_pages: int,
        layout: str = "page_first",
        num_layers: int | None = None,
        allocator: PageAllocator | None = None,
        head_partition: int = 0,
    ) -> None:
        """`num_layers`: more than the device pool's when another pool's layers are appended (a packed
        draft, host_group.py); `allocator`: another pool's, whose page ids this one follows;
        `head_partition`: KV heads per group for page_unified (0: this rank's heads are one group)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown host layout {layout!r}")
        self.layout = layout
        self.page_size = device_pool.page_size
        self.num_layers = num_layers or device_pool.num_layers
        self.row = device_pool.layout.row_numel
        self.dtype = device_pool.dtype
        self.allocator = allocator or PageAllocator(num_pages, self.page_size, device_pool.placement.shards)
        self.placement = self.allocator.placement
        self.shard_rank = device_pool.shard_rank
        self.local_pages = num_pages
        pin = device_pool.device.type == "cuda"
        self.unified = _unified_shape(device_pool, head_partition) if layout == "page_unified" else None
        if self.unified is not None:
            groups, heads, dim = self.unified
            shape: tuple[int, ...] = (num_pages, groups, self.num_layers, 2, self.page_size, heads, dim)
        elif layout == "layer_first":
            shape = (self.num_layers, num_pages * self.page_size, self.row)
        else:  # page_first, and page_unified of a row that is not K/V heads (MLA)
            shape = (num_pages, self.num_layers, self.page_size, self.row)
        self.buffer = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        self.capacity_tokens = self.allocator.num_pages * self.page_size  # logical, over every shard

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.page_size * self.row * self.buffer.element_size()

    @property
    def parts(self) -> list[PagePart]:
        """What storage keeps of a page: one object, every layer (host_group.py splits a grouped page)."""
        return [PagePart("", self, range(self.num_layers))]

    @property
    def page_contiguous(self) -> bool:
        """A page's bytes are one span of the buffer (storage reads land in place)."""
        return self.layout != "layer_first"

    def _host_pages_of_layer(self, layer: int) -> torch.Tensor:
        """Layer `layer` of every host page as a [pages, page_size * row] view (strided for page_first)."""
        if self.layout != "layer_first":
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

    def backup(
        self, device: DeviceKVPool, device_pages: list[int], host_pages: list[int], first_layer: int = 0
    ) -> None:
        """Copy whole pages device -> host, every layer of `device`, to host layers from `first_layer`
        (this rank's pairs)."""
        d, h = self._own_pairs(device_pages, host_pages)
        for layer in range(device.num_layers):
            rows = device.layer_pages(layer, d)
            if self.unified is not None:
                self._pack(first_layer + layer, h, device.pages_of_layer(layer), rows)
                continue
            self._copy(self._host_pages_of_layer(first_layer + layer), h, device.pages_of_layer(layer), rows)

    def load_layer(
        self, device: DeviceKVPool, layer: int, host_pages: list[int], device_pages: list[int], first_layer: int = 0
    ) -> None:
        """Copy one layer of whole pages host -> device (host layer `first_layer + layer`; this rank's
        pairs)."""
        d, h = self._own_pairs(device_pages, host_pages)
        d = device.layer_pages(layer, d)
        if self.unified is not None:
            self._unpack(first_layer + layer, h, device.pages_of_layer(layer), d)
            return
        self._copy(device.pages_of_layer(layer), d, self._host_pages_of_layer(first_layer + layer), h)

    # page_unified: a device row is (token, K/V, group, head, dim); a host layer is (group, K/V, token, head, dim)
    def _pack(self, layer: int, host_pages: list[int], src: torch.Tensor, device_pages: list[int]) -> None:
        if not host_pages:
            return
        assert self.unified is not None
        groups, heads, dim = self.unified
        d = torch.tensor(device_pages, dtype=torch.int64, device=src.device)
        rows = src.index_select(0, d).view(len(device_pages), self.page_size, 2, groups, heads, dim)
        # Blocking: a non_blocking device -> host copy into a fresh tensor may still be running when
        # the index_put below reads it (the direct copies of _copy land in the pinned buffer itself).
        packed = rows.permute(0, 3, 2, 1, 4, 5).to(self.buffer.device)
        self.buffer[torch.tensor(host_pages, dtype=torch.int64), :, layer] = packed

    def _unpack(self, layer: int, host_pages: list[int], dst: torch.Tensor, device_pages: list[int]) -> None:
        if not host_pages:
            return
        packed = self.buffer[torch.tensor(host_pages, dtype=torch.int64), :, layer]  # [n, G, 2, ps, H, D]
        rows = packed.permute(0, 3, 2, 1, 4, 5).reshape(len(host_pages), -1)
        d = torch.tensor(device_pages, dtype=torch.int64, device=dst.device)
        dst.index_copy_(0, d, rows.to(dst.device, non_blocking=True))

    def resident_bytes(self) -> int:
        """Bytes of KV this rank holds for allocated host pages (its own class only when sharded)."""
        return self.allocator.used_by_class()[self.shard_rank] * self.page_bytes

    def _page(self, host_page: int, layers: range | None) -> torch.Tensor:
        """Layers `layers` (all by default) of one of this rank's pages: [layers, page_size, row]."""
        host_page = self._local(host_page)
        a, b = (0, self.num_layers) if layers is None else (layers.start, layers.stop)
        if self.unified is not None:  # contiguous for every layer, or for one head group
            return self.buffer[host_page, :, a:b]
        if self.layout != "layer_first":
            return self.buffer[host_page, a:b]
        s = host_page * self.page_size
        return self.buffer[a:b, s : s + self.page_size]

    def page_bytes_of(self, layers: range) -> int:
        return len(layers) * self.page_size * self.row * self.buffer.element_size()

    def page_payload(self, host_page: int, layers: range | None = None) -> bytes:
        """One page (its layers `layers`, all by default) as bytes in page_first order, or page_unified's
        own (the storage object's payload)."""
        return self._page(host_page, layers).contiguous().view(torch.uint8).numpy().tobytes()

    def page_view(self, host_page: int, layers: range | None = None) -> memoryview:
        """A writable byte view of one page's layers (page_first / page_unified), so storage reads land
        in place."""
        assert self.page_contiguous
        return memoryview(self._page(host_page, layers).view(torch.uint8).reshape(-1).numpy())

    def write_page(self, host_page: int, payload: bytes | memoryview, layers: range | None = None) -> None:
        """Inverse of `page_payload`."""
        dst = self._page(host_page, layers)
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype)
        dst.copy_(src.view(dst.shape))


@dataclass(frozen=True)
class PartShard:
    """Where one rank's copy of a part sits in its model's whole state, for a layout whose object names
    are the same on every rank (the unified key scheme): the model's KV heads this rank holds of its
    `num_kv_heads`, and whether another rank writes the same bytes (`replica`: a pipeline stage after the
    first holding the same whole draft, a TP rank holding a copy of a draft that does not split)."""

    heads: range
    num_kv_heads: int
    replica: bool = False


@dataclass(frozen=True)
class PagePart:
    """The unit of storage: layers `layers` of one host pool, one object per page. `name` is "" for the
    target's part (its keys are those of a cache without a draft) and "draft" for the draft's."""

    name: str
    host: HostKVPool
    layers: range
    identity: str | None = None  # the model whose state this is; None: the cache's target model
    shard: PartShard | None = None  # None: this rank holds the whole part and writes it

    @property
    def payload_bytes(self) -> int:
        return self.host.page_bytes_of(self.layers)

    @property
    def row_layout(self) -> str:
        """What a stored page's bytes are, for the storage namespace."""
        return f"page_rows:{self.host.row}x{len(self.layers)}"

    @property
    def dtype_name(self) -> str:
        return str(self.host.dtype).removeprefix("torch.")

    def payload(self, host_page: int) -> bytes:
        return self.host.page_payload(host_page, self.layers)

    @property
    def contiguous(self) -> bool:
        """The part's bytes are one span of its page (storage reads land in place, `view`). Not so for
        some of the layers of a page_unified page of several head groups (a packed draft's pool):
        those go through `payload` / `write`, which keep the page_unified order all the same."""
        host = self.host
        whole = host.unified is None or host.unified[0] == 1 or len(self.layers) == host.num_layers
        return host.page_contiguous and whole

    def view(self, host_page: int) -> memoryview:
        assert self.contiguous
        return self.host.page_view(host_page, self.layers)

    def write(self, host_page: int, payload: bytes | memoryview) -> None:
        self.host.write_page(host_page, payload, self.layers)


def _unified_shape(device_pool: DeviceKVPool, head_partition: int) -> tuple[int, int, int] | None:
    """(groups, heads per group, head_dim) of this rank's K/V for page_unified; None for other rows."""
    comps = device_pool.layout.components
    if [c.name for c in comps] != ["k", "v"] or len(comps[0].shape) != 2:
        return None
    heads, dim = comps[0].shape
    per = head_partition or heads
    if heads % per:
        raise ValueError(f"head partition {per} does not divide this rank's {heads} KV heads")
    return heads // per, per, dim


def _runs(dst: list[int], src: list[int]) -> list[tuple[int, int, int]]:
    """(dst_start, src_start, length) of maximal runs where both sides advance by one page."""
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst, src):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((d, s, 1))
    return runs
