"""Page ownership as a cut of a P/D transfer (hicache/disagg/cells.py, "page ownership"): under context
parallelism each prefill rank holds only the pages it owns, so it reads and sends exactly those, naming
them; decode lands each page once, whichever of its sources sent it, and refuses a transfer whose
sources repeat a page or leave one out (a page from a rank that does not own it would be another rank's
bytes, or none). A decode rank whose own pages are sharded keeps the rows of the pages it owns."""

from __future__ import annotations

import pytest
import torch

from hicache.disagg import cells, wire
from hicache.disagg.handshake import Handshake
from hicache.disagg.kv_rows import PoolRows, frames_of, tokens_of
from hicache.disagg.transfer import DecodeMetadata, KVPoll, PrefillResult
from hicache.disagg.zmq_decode import ZmqDecodeBackend, _Room, _Source
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout

PAGE, LOCAL_PAGES, LAYERS = 4, 8, 2
LAYOUT = KVLayout.mha(1, 2)
# A request's logical pages on a CP2 prefill: owners 0, 1, 0, 1, 1 (by page id, not by position).
PREFILL_PAGES = [2, 5, 4, 7, 9]
PROMPT = 19  # the last page half full


def cp_pool(rank: int, shards: int = 2, fill: bool = True) -> DeviceKVPool:
    """A sharded pool whose every local row holds (layer, logical slot): a row says where it came from."""
    pool = DeviceKVPool(LAYOUT, LAYERS, LOCAL_PAGES, PAGE, torch.float32, torch.device("cpu"), shards, rank)
    if fill:
        logical = torch.tensor([pool.placement.slot_of(rank, row) for row in range(LOCAL_PAGES * PAGE)])
        for layer, buffer in enumerate(pool.buffers):
            buffer[:, 0], buffer[:, 1] = layer + 1, logical.float()
    return pool


PREFILL = [cp_pool(0), cp_pool(1)]


def want_slot(token: int) -> int:
    """The prefill slot of a prompt token: what its landed row must say."""
    return PREFILL_PAGES[token // PAGE] * PAGE + token % PAGE


@pytest.mark.parametrize("start,end", [(0, PROMPT), (4, 12), (8, PROMPT), (16, PROMPT)])
def test_each_cp_rank_reads_the_pages_it_owns_and_together_they_read_each_page_once(start, end):
    held = [PoolRows(pool, PREFILL_PAGES, 0, PROMPT).held(start, end) for pool in PREFILL]
    assert sorted(held[0] + held[1]) == list(range(start // PAGE, -(-end // PAGE))), "every page, once"
    for pool, pages in zip(PREFILL, held):
        assert all(pool.placement.owner(PREFILL_PAGES[q]) == pool.shard_rank for q in pages)
        rows = PoolRows(pool, PREFILL_PAGES, 0, PROMPT).read(start, end)
        tokens = tokens_of(pages, start, end, PAGE).tolist()
        assert rows[1][:, 1].tolist() == [want_slot(t) for t in tokens]
        assert rows[1][:, 0].tolist() == [2] * len(tokens)


def handshake(page_shards: int) -> Handshake:
    return Handshake(
        model="m", dtype="float32", page_size=PAGE, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, layers=(0, LAYERS),
        num_layers=LAYERS, num_kv_heads=1, latent=False, verified=True, mechanisms=(), page_shards=page_shards,
        kv_layout=tuple((c.name, tuple(c.shape)) for c in LAYOUT.components),
        cp_size=page_shards,
    )  # fmt: skip


def transfer(
    decode: DeviceKVPool, decode_pages: list[int], claims: list[list[int] | None], prefix: int = 0
) -> tuple[KVPoll, str]:
    """Run one request's transfer of the tokens after `prefix` (decode_prefix_len) from the two CP ranks
    into `decode` (its pages `decode_pages`), rank r claiming to send pages `claims[r]` (None: the pages
    it owns) with the rows it holds of them."""
    hs = handshake(decode.placement.shards)
    backend = ZmqDecodeBackend(decode, hs, timeout_s=30)
    try:
        meta = DecodeMetadata(1, prefix, PROMPT, "digest", hs)
        cuts = cells.cuts(hs, cells.shard(hs), draft=False)
        slots = decode.allocator.slots(decode_pages, PROMPT)[prefix:]
        state = _Room(1, "tcp://127.0.0.1:1", KVPoll.WAITING_FOR_INPUT, meta, slots)
        state.sources = {f"cp{r}": _Source(cuts, prefix, sharded=True) for r in range(2)}
        state.deadline = float("inf")
        backend._rooms[1] = state
        for r, pool in enumerate(PREFILL):
            rows = PoolRows(pool, PREFILL_PAGES, prefix, PROMPT)
            pages = rows.held(prefix, PROMPT) if claims[r] is None else claims[r]
            slots = pool.allocator.slots(PREFILL_PAGES, PROMPT)[tokens_of(pages, prefix, PROMPT, PAGE)]
            chunk = [buffer[pool.placement.local_rows(slots)] for buffer in pool.buffers]
            header = {"room": 1, "start": prefix, "end": PROMPT, "pages": pages}
            backend._on_message(f"cp{r}", wire.KV, header, frames_of(chunk, cuts))
            done = wire.result_header(1, PROMPT, PrefillResult(7, None, {}))
            backend._on_message(f"cp{r}", wire.DONE, done, [])
        return state.status, state.error or ""
    finally:
        backend.shutdown()


def test_a_tp1_decode_lands_every_page_from_its_owner():
    decode = DeviceKVPool(LAYOUT, LAYERS, 8, PAGE, torch.float32, torch.device("cpu"))
    decode_pages = [6, 1, 3, 0, 2]
    assert transfer(decode, decode_pages, [None, None]) == (KVPoll.SUCCESS, "")
    slots = decode.allocator.slots(decode_pages, PROMPT)
    for layer, buffer in enumerate(decode.buffers):
        assert buffer[slots, 1].tolist() == [want_slot(t) for t in range(PROMPT)]
        assert buffer[slots, 0].tolist() == [layer + 1] * PROMPT
    # Decode held the first four pages: only the last crosses, and rank 0, which does not own it, sends
    # an empty message (its turn in the chunk's order) and DONE.
    decode = DeviceKVPool(LAYOUT, LAYERS, 8, PAGE, torch.float32, torch.device("cpu"))
    assert transfer(decode, decode_pages, [None, None], prefix=16) == (KVPoll.SUCCESS, "")
    assert decode.buffers[0][slots, 1].tolist() == [0.0] * 16 + [want_slot(t) for t in range(16, PROMPT)]


def test_a_cp2_decode_rank_keeps_the_pages_it_owns():
    decode_pages = [3, 4, 6, 9, 11]  # decode's own allocation: owners 1, 0, 0, 1, 1
    for rank in range(2):
        decode = cp_pool(rank, fill=False)
        assert transfer(decode, decode_pages, [None, None]) == (KVPoll.SUCCESS, "")
        mine = [q for q, page in enumerate(decode_pages) if decode.placement.owner(page) == rank]
        tokens = tokens_of(mine, 0, PROMPT, PAGE)
        local = decode.placement.local_rows(decode.allocator.slots(decode_pages, PROMPT)[tokens])
        for layer, buffer in enumerate(decode.buffers):
            assert buffer[local, 1].tolist() == [want_slot(t) for t in tokens.tolist()]
            assert int((buffer[:, 0] != 0).sum()) == len(tokens), "nothing lands but its own pages' rows"


def test_a_page_sent_by_two_ranks_or_by_none_fails_the_transfer():
    decode = DeviceKVPool(LAYOUT, LAYERS, 8, PAGE, torch.float32, torch.device("cpu"))
    status, error = transfer(decode, [6, 1, 3, 0, 2], [None, [0, 1, 3, 4]])  # rank 1 also claims page 0
    assert status is KVPoll.FAILED and "pages [0] came from two prefill ranks" in error
    status, error = transfer(decode, [6, 1, 3, 0, 2], [None, [1, 3]])  # nobody sends page 4
    assert status is KVPoll.FAILED and "no prefill rank sent pages [4]" in error
