"""A prefill rank reads a request's rows out of its device pages a chunk at a time (hicache/disagg/
kv_rows.py, `PoolRows`): any chunk of any request, across page boundaries and out-of-order pages, is the
rows of those tokens, every layer, and a chunk outside the transfer is refused. With a speculative draft
(docs/DESIGN.md, "Speculation x P/D") its pool's rows, of another shape, travel after the target's and
land in the decode side's draft pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.disagg import cells
from hicache.disagg.handshake import Handshake
from hicache.disagg.kv_rows import PoolRows, frames_of, land
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout

PAGE, NUM_PAGES, LAYERS = 4, 12, 3


def filled_pool(layout: KVLayout = KVLayout.mha(1, 2), layers: int = LAYERS, first: int = 0) -> DeviceKVPool:
    """Every slot's row holds (layer, slot) in its first two columns, so a row says where it came from."""
    pool = DeviceKVPool(layout, layers, NUM_PAGES, PAGE, torch.float32, torch.device("cpu"))
    for layer, buffer in enumerate(pool.buffers):
        buffer[:, 0] = first + layer
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
    for layer, got in chunk.items():
        assert got.shape == (b - a, 4)
        assert got[:, 0].tolist() == [layer] * (b - a)
        assert got[:, 1].tolist() == want_slots


def test_a_chunk_outside_the_transfer_is_refused():
    rows = PoolRows(POOL, [3, 5], 4, 7)
    with pytest.raises(ValueError, match=r"rows \[2, 5\) outside \[4, 7\)"):
        rows.read(2, 5)
    with pytest.raises(ValueError, match=r"outside"):
        rows.read(5, 9)


def test_a_drafts_rows_travel_after_the_targets_and_land_in_its_own_pool():
    draft = filled_pool(KVLayout.mha(2, 3), 2, first=LAYERS)  # another row shape: 2 heads of 3
    hs = Handshake(
        model="m", dtype="float32", page_size=PAGE, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, layers=(0, LAYERS),
        num_layers=LAYERS, num_kv_heads=1, latent=False, kv_layout=tuple((c.name, tuple(c.shape))
        for c in POOL.layout.components), verified=True, mechanisms=(), draft="d", draft_layers=2,
        draft_kv_layout=tuple((c.name, tuple(c.shape)) for c in draft.layout.components),
    )  # fmt: skip
    parts = cells.cuts(hs, cells.shard(hs), cells.sends_draft(hs, hs))
    frames = frames_of(PoolRows(POOL, [3, 5], 4, 7, draft).read(4, 7), parts)
    assert [len(f) for f in frames] == [3 * 4 * 4] * LAYERS + [3 * 12 * 4] * 2
    target = DeviceKVPool(POOL.layout, LAYERS, NUM_PAGES, PAGE, torch.float32, torch.device("cpu"))
    landed = DeviceKVPool(draft.layout, 2, NUM_PAGES, PAGE, torch.float32, torch.device("cpu"))
    slots = torch.tensor([8, 9, 10])
    assert land(target.buffers + landed.buffers, slots, frames, parts) == sum(len(f) for f in frames)
    for got, want in zip(target.buffers + landed.buffers, POOL.buffers + draft.buffers):
        assert torch.equal(got[slots], want[torch.tensor([20, 21, 22])])  # tokens 4-6: page 5
    with pytest.raises(ValueError, match="frames for cells of 5 layers"):
        land(target.buffers + landed.buffers, slots, frames[:LAYERS], parts)  # a peer that moves no draft
