"""A prefill rank reads a request's rows out of its device pages a chunk at a time (hicache/disagg/
kv_rows.py, `PoolRows`): any chunk of any request, across page boundaries and out-of-order pages, is the
rows of those tokens, every layer, and a chunk outside the transfer is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.disagg.kv_rows import PoolRows
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout

PAGE, NUM_PAGES, LAYERS = 4, 12, 3


def filled_pool() -> DeviceKVPool:
    """Every slot's row holds (layer, slot) in its first two columns, so a row says where it came from."""
    pool = DeviceKVPool(KVLayout.mha(1, 2), LAYERS, NUM_PAGES, PAGE, torch.float32, torch.device("cpu"))
    for layer, buffer in enumerate(pool.buffers):
        buffer[:, 0] = layer
        buffer[:, 1] = torch.arange(buffer.shape[0], dtype=torch.float32)
    return pool


POOL = filled_pool()


@settings(max_examples=60, deadline=None)
@given(
    pages=st.permutations(range(NUM_PAGES)).map(lambda p: p[:8]),
    data=st.data(),
)
def test_any_chunk_is_the_rows_of_its_tokens_in_the_request_s_pages(pages, data):
    end = data.draw(st.integers(1, len(pages) * PAGE))
    start = data.draw(st.integers(0, end - 1).map(lambda x: x - x % PAGE))  # a transfer starts on a page
    rows = PoolRows(POOL, pages, start, end)
    a = data.draw(st.integers(start, end))
    b = data.draw(st.integers(a, end))
    chunk = rows.read(a, b)
    want_slots = [pages[t // PAGE] * PAGE + t % PAGE for t in range(a, b)]
    assert len(chunk) == LAYERS
    for layer, got in enumerate(chunk):
        assert got.shape == (b - a, 4)
        assert got[:, 0].tolist() == [layer] * (b - a)
        assert got[:, 1].tolist() == want_slots


def test_a_chunk_outside_the_transfer_is_refused():
    rows = PoolRows(POOL, [3, 5], 4, 7)
    with pytest.raises(ValueError, match=r"rows \[2, 5\) outside \[4, 7\)"):
        rows.read(2, 5)
    with pytest.raises(ValueError, match=r"outside"):
        rows.read(5, 9)
