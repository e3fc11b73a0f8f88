"""The device KV pool: rows written at logical slots read back exactly, per layer, and a page's rows are
the contiguous unit tier copies move."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout

LAYOUT = KVLayout.mha(kv_heads=2, head_dim=4)


def _pool(dtype=torch.float32) -> DeviceKVPool:
    return DeviceKVPool(LAYOUT, num_layers=3, num_pages=6, page_size=4, dtype=dtype, device=torch.device("cpu"))


@settings(max_examples=50, deadline=None)
@given(slots=st.lists(st.integers(0, 23), min_size=1, max_size=24, unique=True), layer=st.integers(0, 2))
def test_rows_written_at_slots_read_back_exactly_on_their_layer_only(slots, layer):
    pool = _pool()
    index = torch.tensor(slots)
    parts = {"k": torch.randn(len(slots), 2, 4), "v": torch.randn(len(slots), 2, 4)}
    pool.write(layer, index, parts)
    back = pool.read(layer, index)
    assert torch.equal(back["k"], parts["k"]) and torch.equal(back["v"], parts["v"])
    for other in {0, 1, 2} - {layer}:
        assert not pool.buffers[other].any(), "a write reached another layer"


def test_a_page_is_its_slots_rows_in_order():
    pool = _pool()
    slots = torch.arange(8, 12)  # page 2
    parts = {"k": torch.randn(4, 2, 4), "v": torch.randn(4, 2, 4)}
    pool.write(1, slots, parts)
    page = pool.pages_of_layer(1)[2].view(4, LAYOUT.row_numel)
    assert torch.equal(page, LAYOUT.pack(parts))


def test_bytes_per_token_counts_every_layer_and_component():
    assert _pool().bytes_per_token == 3 * 2 * (2 * 4) * 4
    assert _pool(torch.bfloat16).bytes_per_token == 3 * 2 * (2 * 4) * 2


def test_writes_are_cast_to_the_pool_dtype():
    pool = _pool(torch.bfloat16)
    parts = {"k": torch.full((1, 2, 4), 1.0 + 2**-12), "v": torch.ones(1, 2, 4)}
    pool.write(0, torch.tensor([5]), parts)
    assert pool.read(0, torch.tensor([5]))["k"].dtype == torch.bfloat16
