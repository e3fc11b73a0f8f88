"""Which cells each prefill rank sends each decode rank (hicache/disagg/cells.py), whatever the two
topologies: every decode rank receives its shard exactly once, both sides compute the same plan, and
rows cut out of prefill's pools and landed in decode's hold the bytes decode would have computed. A
pair whose head boundary cuts a KV row is refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.disagg import cells
from hicache.disagg.handshake import Handshake
from hicache.disagg.kv_rows import frames_of, land
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout
from tests.disagg.test_handshake import BASE

HEAD_DIM = 4


def server(num_layers: int, num_kv_heads: int, tp: int, pp: int, cp: int = 1) -> Handshake:
    """Rank 0's handshake of a server of this topology (`cells.everyone` places the others); at CP > 1
    its pages are sharded over its CP ranks."""
    per = num_kv_heads // tp
    layout = (("k", (per, HEAD_DIM)), ("v", (per, HEAD_DIM)))
    hs = dataclasses.replace(BASE, num_layers=num_layers, num_kv_heads=num_kv_heads, tp_size=tp, pp_size=pp,
                             cp_size=cp, page_shards=cp, kv_layout=layout)  # fmt: skip
    return cells.everyone(hs)[0]


@st.composite
def pairs(draw) -> tuple[Handshake, Handshake]:
    num_layers = draw(st.integers(1, 9))
    num_kv_heads = draw(st.sampled_from([1, 2, 4, 6, 8]))
    tps = [t for t in (1, 2, 3, 4) if num_kv_heads % t == 0]
    sides = [(draw(st.sampled_from(tps)), draw(st.integers(1, min(num_layers, 4))), draw(st.sampled_from([1, 2])))
             for _ in range(2)]  # fmt: skip
    return tuple(server(num_layers, num_kv_heads, tp, pp, cp) for tp, pp, cp in sides)  # type: ignore[return-value]


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(pairs())
def test_every_decode_rank_gets_its_shard_exactly_once_and_both_sides_agree_on_the_plan(pair):
    prefill, decode = pair
    assert cells.misaligned(prefill, decode) is None
    ranks = cells.everyone(prefill)
    for d in cells.everyone(decode):
        mine = cells.shard(d)
        # Every CP rank of prefill holds the same cells, of the pages it owns: each gives them once.
        for cp in range(prefill.cp_size):
            covered = [(layer, head) for p, c in cells.peers(d, prefill).items() if ranks[p].cp_rank == cp
                       for layer in c.layers for head in c.heads]  # fmt: skip
            assert sorted(covered) == [(layer, head) for layer in mine.layers for head in mine.heads]
        for p_rank, shared in cells.peers(d, prefill).items():
            # The prefill rank owes this decode rank exactly the cells the decode rank expects of it.
            assert cells.peers(cells.everyone(prefill)[p_rank], decode)[cells.rank(d)] == shared


@pytest.mark.parametrize(("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"),
                         [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 2, 1, 3), (1, 3, 2, 2)])  # fmt: skip
def test_rows_cut_from_prefill_ranks_land_as_the_decode_ranks_own(prefill_tp, prefill_pp, decode_tp, decode_pp):
    num_layers, num_kv_heads, tokens = 5, 4, 7
    gen = torch.Generator().manual_seed(prefill_tp * 10 + decode_tp + prefill_pp * 100 + decode_pp * 1000)
    model_kv = torch.randn(num_layers, tokens, 2, num_kv_heads, HEAD_DIM, generator=gen)  # K/V of every head

    def rows(hs: Handshake) -> list[torch.Tensor]:
        s = cells.shard(hs)
        return [model_kv[layer][:, :, s.heads].reshape(tokens, -1) for layer in s.layers]

    prefill, decode = server(num_layers, num_kv_heads, prefill_tp, prefill_pp), server(
        num_layers, num_kv_heads, decode_tp, decode_pp)  # fmt: skip
    for d in cells.everyone(decode):
        per = num_kv_heads // decode_tp
        pool = DeviceKVPool(KVLayout.mha(per, HEAD_DIM), len(cells.shard(d).layers), 1, 16, torch.float32,
                            torch.device("cpu"))  # fmt: skip
        slots = torch.arange(3, 3 + tokens - 2)  # tokens [2, tokens) land here
        for p_rank, shared in cells.peers(d, prefill).items():
            p = cells.everyone(prefill)[p_rank]
            for start, end in ((2, 5), (5, tokens)):  # two messages
                frames = frames_of([layer[start:end] for layer in rows(p)], cells.cuts(p, shared, False))
                land(pool.buffers, slots[start - 2 : end - 2], frames, cells.cuts(d, shared, False))
        for got, want in zip(pool.buffers, rows(d)):
            assert torch.equal(got[slots], want[2:]), "decode's rows equal its own shard of the model's KV"
            assert not got[:3].any() and not got[3 + tokens - 2 :].any(), "nothing outside the slots is written"


def test_a_head_boundary_inside_a_row_not_split_by_heads_is_refused_by_name():
    prefill = server(4, 2, 1, 1)
    latent_row = (("latent", (48,)), ("rope", (16,)))
    # A row with a component not split by heads (a latent, a per-token state) at TP1 and TP2.
    p = dataclasses.replace(prefill, kv_layout=latent_row)
    d = dataclasses.replace(server(4, 2, 2, 1), kv_layout=latent_row)
    problem = cells.misaligned(p, d)
    assert problem is not None
    assert "decode rank tp0/pp0 needs KV heads 0-0 of prefill rank tp0/pp0" in problem
    assert "component 'latent' (48,) is not split by KV heads" in problem
    other_rows = dataclasses.replace(server(4, 2, 2, 1), kv_layout=(("k", (1, 8)), ("v", (1, 8))))
    assert "the KV rows differ" in (cells.misaligned(prefill, other_rows) or "")


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.sampled_from([1, 2]), st.integers(1, 4), st.integers(1, 4), st.sampled_from([1, 2]),
       st.sampled_from([1, 2]))  # fmt: skip
def test_each_decode_rank_takes_the_drafts_rows_once_from_a_peer_or_the_pair_is_refused(
    num_layers, tp, p_pp, d_pp, p_cp, d_cp
):
    """Every stage holds the whole draft (its TP share): each decode rank takes it from the prefill ranks of
    its TP rank on one stage that send it target cells anyway (under CP each of that stage's CP ranks, for
    the pages it owns, as for the target's cells), both sides agreeing which."""
    layers = max(num_layers, p_pp, d_pp)
    prefill, decode = (dataclasses.replace(server(layers, 2, tp, pp, cp), draft="d", draft_layers=1,
                                           draft_kv_layout=(("k", (1, HEAD_DIM)),))
                       for pp, cp in ((p_pp, p_cp), (d_pp, d_cp)))  # fmt: skip
    problem = cells.misaligned(prefill, decode)
    if problem is not None:
        assert "shares no layers with prefill's last stage" in problem and 1 < p_pp != d_pp
        return
    for d in cells.everyone(decode):
        senders = [cells.everyone(prefill)[p] for p in cells.peers(d, prefill)
                   if cells.sends_draft(cells.everyone(prefill)[p], d)]  # fmt: skip
        assert sorted(s.cp_rank for s in senders) == list(range(p_cp))
        assert {(s.pp_rank, s.tp_rank) for s in senders} == {(senders[0].pp_rank, d.tp_rank)}
    other_tp = dataclasses.replace(server(4, 2, 3 - tp, 1), draft="d", draft_layers=1)
    assert "between two TP sizes" in (cells.misaligned(prefill, other_tp) or "")
    # Pages sharded over TP (an MLA model's): the draft's pages are not, so no rank set sends them alike.
    mla = dataclasses.replace(server(layers, 2, tp, p_pp), page_shards=2, draft="d", draft_layers=1,
                              draft_kv_layout=(("k", (1, HEAD_DIM)),))  # fmt: skip
    assert cells.misaligned(mla, decode) == cells.misaligned(prefill, mla) == cells.SHARDED_DRAFT
