"""Small real pools for the cache's unit tests, and a content oracle: the KV a fake model writes for
token t at position i of layer l is a value only that (t, i, l) has, so a page served from any tier
can be checked against the tokens it is served for, and a failure names the tier that got it wrong."""

from __future__ import annotations

from typing import Sequence

import torch

from hicache.cache.device_tier import DeviceTier
from hicache.cache.host_tier import HostTier, WritePolicy
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_pool import HostKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.parallel.consensus import Consensus
from hicache.parallel.parallel import ParallelContext

PAGE = 4
LAYERS = 2
LAYOUT = KVLayout.mha(1, 2)


def device_pool(num_pages: int = 16) -> DeviceKVPool:
    return DeviceKVPool(LAYOUT, LAYERS, num_pages, PAGE, torch.float32, torch.device("cpu"))


def one_rank() -> Consensus:
    return Consensus(ParallelContext())


def expected(tokens: Sequence[int], layer: int) -> torch.Tensor:
    """What the fake model writes for tokens[0:n] at layer `layer`: [n, row] (exact in float32)."""
    base = torch.tensor([t * 1000 + i + layer * 100_000 for i, t in enumerate(tokens)], dtype=torch.float32)
    return base.unsqueeze(1).repeat(1, LAYOUT.row_numel)


def slots(pool: DeviceKVPool, pages: Sequence[int], start: int, end: int) -> torch.Tensor:
    return pool.allocator.slots(list(pages), end)[start:end]


def write_kv(pool: DeviceKVPool, pages: Sequence[int], tokens: Sequence[int], start: int = 0) -> None:
    """Compute tokens[start:] into `pages` (which hold the whole sequence), as a forward pass would."""
    rows = slots(pool, pages, start, len(tokens))
    for layer in range(pool.num_layers):
        pool.buffers[layer][rows] = expected(tokens, layer)[start:]


def assert_kv(pool: DeviceKVPool, pages: Sequence[int], tokens: Sequence[int], tier: str) -> None:
    """The device pages hold the KV of `tokens`; otherwise the message names the tier that served them."""
    rows = slots(pool, pages, 0, len(tokens))
    for layer in range(pool.num_layers):
        got = pool.buffers[layer][rows]
        bad = (got != expected(tokens, layer)).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{tier} tier served wrong KV: layer {layer}, token positions {bad[:8]}"


def assert_host_kv(
    host: HostKVPool, host_pages: Sequence[int], tokens: Sequence[int], tier: str, first_page: int = 0
) -> None:
    """Host pages hold the KV of pages first_page, first_page + 1, ... of the sequence `tokens`."""
    for layer in range(host.num_layers):
        want = expected(tokens, layer)
        for i, page in enumerate(host_pages, start=first_page):
            got = torch.frombuffer(bytearray(host.page_payload(page)), dtype=torch.float32)
            if host.unified is not None:  # page_unified: (group, layer, K/V, token, head, dim) -> rows
                g, h, d = host.unified
                got = got.view(g, host.num_layers, 2, host.page_size, h, d).permute(1, 3, 2, 0, 4, 5)
            got = got.reshape(host.num_layers, host.page_size, host.row)[layer]
            good = torch.equal(got, want[i * PAGE : (i + 1) * PAGE])
            assert good, f"{tier} tier holds wrong KV: layer {layer}, page {i}"


def tiers(
    device_pages: int = 16, host_pages: int = 32, policy: WritePolicy = WritePolicy.WRITE_THROUGH, threshold: int = 0,
    layout: str = "page_first",
) -> tuple[DeviceTier, HostTier]:  # fmt: skip
    """A device tier and a host tier over one tree, wired as the hierarchical cache wires them."""
    pool = device_pool(device_pages)
    host_pool = HostKVPool(pool, host_pages, layout)
    device = DeviceTier(pool, on_host_free=host_pool.allocator.free)
    return device, HostTier(pool, host_pool, device.tree, device.budget, one_rank(), policy, threshold)


def compute(device: DeviceTier, tokens: Sequence[int]) -> list:
    """Compute `tokens` (a page multiple) into new device pages and cache them; the new nodes."""
    pages = device.alloc(len(tokens) // PAGE)
    write_kv(device.pool, pages, tokens)
    return device.insert(tokens, pages, "").new_nodes


def settle(tier: HostTier) -> list:
    """Wait for every copy in flight, then consume all ACKs as a scheduler check would; the nodes
    backed up."""
    for op in tier.backups.running() + tier.loads.running():
        op.done.wait()
    return tier.consume_acks(*tier.acks_ready())
