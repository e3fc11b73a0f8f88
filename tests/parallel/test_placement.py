"""Page placement arithmetic (hicache/parallel/placement.py): a bijection between logical slots and (owner,
local row), the worked example of docs/DESIGN.md, "CP page sharding" (figure 1a) through the cache API, and
which ranks shard and write pages."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.build import device_cache
from hicache.cache.prefix_cache import PrefixCache
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.parallel.parallel import Mesh, ParallelContext
from hicache.parallel.placement import Placement, kv_sharding, storage_shard


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.sampled_from([1, 2, 4, 16]), st.integers(2, 12))
def test_placement_is_a_bijection_between_slots_and_owner_rows(shards, page_size, local_pages):
    placement = Placement(shards, page_size)
    seen = {}
    for x in range(shards * local_pages * page_size):  # every logical slot of every rank's pages
        q = x // page_size
        r, row = placement.owner(q), placement.local_row(x)
        assert 0 <= r < shards and 0 <= row < local_pages * page_size
        assert (r, row) not in seen, f"slots {seen.get((r, row))} and {x} share a row"
        seen[(r, row)] = x
        assert placement.slot_of(r, row) == x
        assert placement.logical_page(r, placement.local_page(q)) == q
    assert len(seen) == shards * local_pages * page_size  # onto: every row of every rank is some slot
    slots = torch.arange(shards * local_pages * page_size)
    assert placement.owners(slots).tolist() == [placement.owner(int(x) // page_size) for x in slots]
    assert placement.local_rows(slots).tolist() == [placement.local_row(int(x)) for x in slots]


def test_padding_pages_are_reserved_only_when_sharded():
    assert Placement(1, 4).class_pages(0, 3) == [0, 1, 2]
    assert Placement(2, 4).class_pages(0, 3) == [2, 4] and Placement(2, 4).class_pages(1, 3) == [3, 5]


def _run(cache: PrefixCache, rid: int, tokens: list[int]):
    handle = cache.open(rid, tokens, "")
    assert cache.admit(handle, -(-len(tokens) // 4)).admitted
    cache.extend(handle, len(tokens))
    handle.advance(len(tokens))
    cache.cache_prefix(handle, tokens)
    return handle


def test_figure_1a_two_ranks_share_a_b_and_d_lands_on_rank_1_local_page_2():
    """Every CP rank keeps this same tree and pages; the pool translates a logical page to its owner
    and local page. Convention: logical pages 0 and 1 are ranks 0 and 1's padding pages."""
    pool = DeviceKVPool(KVLayout.mha(1, 2), 1, 8, 4, torch.float32, torch.device("cpu"), shards=2, shard_rank=0)
    cache = device_cache(pool)
    a, b, c, d, e = ([letter] * 4 for letter in (65, 66, 67, 68, 69))
    abc = _run(cache, 1, a + b + c)
    abe = _run(cache, 2, a + b + e)
    abcd = _run(cache, 3, a + b + c + d)
    where = {name: (pool.placement.owner(q), pool.placement.local_page(q), q)
             for name, q in zip("ABCE", abc.pages + abe.pages[2:])}  # fmt: skip
    # Rank 0 stores A, C and E at local pages 1, 2 and 3; rank 1 stores B at local page 1.
    assert where == {"A": (0, 1, 2), "B": (1, 1, 3), "C": (0, 2, 4), "E": (0, 3, 6)}
    assert abe.pages[:2] == abc.pages[:2] and abcd.pages[:3] == abc.pages  # one logical tree, shared pages
    # Extending A/B/C continues its owner cycle 0, 1, 0, then 1: D is logical page 5, rank 1's page 2.
    q = abcd.pages[3]
    assert (pool.placement.owner(q), pool.placement.local_page(q), q) == (1, 2, 5)


def _ctx(mesh: Mesh, rank: int) -> ParallelContext:
    c = mesh.coords_of(rank)
    return ParallelContext(tp_size=mesh.tp, tp_rank=c["tp"], pp_size=mesh.pp, pp_rank=c["pp"],
                           cp_size=mesh.cp, cp_rank=c["cp"])  # fmt: skip


def test_shard_groups_cp_first_then_mla_over_tp_and_gqa_without_cp_unsharded():
    assert kv_sharding(_ctx(Mesh(cp=2, tp=2), 3), replicated_over_tp=False).axis == "cp"
    assert kv_sharding(_ctx(Mesh(cp=2, tp=2), 3), replicated_over_tp=True).axis == "cp"
    mla_tp = kv_sharding(_ctx(Mesh(tp=2), 1), replicated_over_tp=True)
    assert (mla_tp.axis, mla_tp.size, mla_tp.rank, mla_tp.split_tokens) == ("tp", 2, 1, False)
    assert kv_sharding(_ctx(Mesh(tp=2), 1), replicated_over_tp=False).size == 1


def test_one_storage_writer_per_shard_rank_and_distinct_copy():
    """SGLang #37149: electing the writer over the whole CP x TP attention group left CP rank 1's pages
    unwritten. Here every distinct copy of the bytes (shard rank x what the TP rank holds) has exactly
    one writer, and readers of one copy share its key."""
    for mesh, replicated in ((Mesh(cp=2, tp=2), True), (Mesh(cp=2, tp=2), False), (Mesh(tp=2), True),
                             (Mesh(pp=2, cp=2), False)):  # fmt: skip
        shards = {}
        for rank in range(mesh.world_size):
            pctx = _ctx(mesh, rank)
            shard = storage_shard(pctx, kv_sharding(pctx, replicated), replicated)
            shards.setdefault(shard.suffix, []).append(shard.writes)
        assert all(writes.count(True) == 1 for writes in shards.values()), (mesh, replicated, shards)
    pctx = _ctx(Mesh(cp=2, tp=2), 3)  # cp1, tp1 of an MLA model: reads what cp1, tp0 writes
    assert storage_shard(pctx, kv_sharding(pctx, True), True).suffix == "latent_pp0of1_cp1of2"
    assert storage_shard(ParallelContext(), kv_sharding(ParallelContext(), False), False).suffix == "tp0of1_pp0of1"
