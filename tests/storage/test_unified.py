"""The unified layout's grid, names and shard arithmetic (hicache/storage/unified.py), including the
worked example of docs/DESIGN.md, "Unified layout" (figure 4)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.errors import UserError
from hicache.storage import unified as u

PAGE_HASH = bytes(range(32))
SEED = u.KVGeometry(num_layers=60, num_kv_heads=8, head_dim=128)
SEED_GRID = u.Grid(SEED, layer_partition=30, head_partition=2)


def names(grid: u.Grid, cells) -> set[str]:
    ns = u.UnifiedNamespace("m", "bfloat16", 64, grid)
    return {ns.object_key(PAGE_HASH, c) for c in cells}


def test_seed_example_eight_objects_per_page():
    assert len(SEED_GRID.cells) == 8
    suffixes = [c.suffix for c in SEED_GRID.cells]
    assert suffixes[:2] == ["L0-29_H0", "L30-59_H0"] and suffixes[-1] == "L30-59_H3"


def test_seed_example_tp4_pp2_writer_one_object_per_rank():
    written = []
    for pp in range(2):
        for tp in range(4):
            shard = u.shard_of(SEED, 4, tp, 2, pp)
            u.check_aligned(SEED_GRID, shard)
            cells = u.writes(SEED_GRID, shard)
            assert len(cells) == 1
            written += cells
    assert sorted(c.suffix for c in written) == sorted(c.suffix for c in SEED_GRID.cells)
    # The expanded object of the figure: heads 4-5 over layers 30-59, K and V, one contiguous range.
    cell = u.writes(SEED_GRID, u.shard_of(SEED, 4, 2, 2, 1))[0]
    assert cell.suffix == "L30-59_H2" and SEED_GRID.group_heads(cell.group) == range(4, 6)
    (span,) = u.reads(SEED_GRID, u.shard_of(SEED, 4, 2, 2, 1), 64, 2)
    assert (span.offset, span.length) == (0, 30 * 2 * 64 * 2 * 128 * 2)


def test_seed_example_tp2_pp1_reader_needs_four_per_rank():
    tp0 = u.reads(SEED_GRID, u.shard_of(SEED, 2, 0, 1, 0), 64, 2)
    assert [s.cell.suffix for s in tp0] == ["L0-29_H0", "L30-59_H0", "L0-29_H1", "L30-59_H1"]
    tp1 = u.reads(SEED_GRID, u.shard_of(SEED, 2, 1, 1, 0), 64, 2)
    assert [s.cell.suffix for s in tp1] == ["L0-29_H2", "L30-59_H2", "L0-29_H3", "L30-59_H3"]
    # Whole objects, laid end to end in the reader's host page (group major, then layers).
    lb = SEED_GRID.layer_bytes(64, 2)
    assert [(s.offset, s.length, s.local_offset) for s in tp0] == [
        (0, 30 * lb, 0),
        (0, 30 * lb, 30 * lb),
        (0, 30 * lb, 60 * lb),
        (0, 30 * lb, 90 * lb),
    ]
    assert u.local_page_bytes(SEED_GRID, u.shard_of(SEED, 2, 0, 1, 0), 64, 2) == 120 * lb


def test_tp2_names_are_the_union_of_tp4s():
    tp4 = set().union(*(names(SEED_GRID, u.writes(SEED_GRID, u.shard_of(SEED, 4, r, 2, p)))
                        for r in range(4) for p in range(2)))  # fmt: skip
    tp2 = set().union(*(names(SEED_GRID, [s.cell for s in u.reads(SEED_GRID, u.shard_of(SEED, 2, r, 1, 0), 64, 2)])
                        for r in range(2)))  # fmt: skip
    assert tp2 == tp4 and len(tp2) == 8


def test_every_namespace_field_changes_the_digest():
    base = u.UnifiedNamespace("model-a", "bfloat16", 64, SEED_GRID)
    variants = [
        dataclasses.replace(base, model="model-b"),
        dataclasses.replace(base, kv_dtype="float16"),
        dataclasses.replace(base, page_size=32),
        dataclasses.replace(base, schema_version=2),
        dataclasses.replace(base, grid=u.Grid(SEED, 20, 2)),
        dataclasses.replace(base, grid=u.Grid(SEED, 30, 4)),
        dataclasses.replace(base, grid=u.Grid(dataclasses.replace(SEED, head_dim=64), 30, 2)),
        dataclasses.replace(base, grid=u.Grid(dataclasses.replace(SEED, num_layers=61), 30, 2)),
        # Another part of a page (a speculative draft's state), even of the same model and grid.
        dataclasses.replace(base, part="draft"),
        # Replication mode and object layout: an MLA model of otherwise equal numbers.
        dataclasses.replace(base, grid=u.Grid(dataclasses.replace(SEED, latent=True), 30, 2)),
    ]
    digests = {base.digest} | {v.digest for v in variants}
    assert len(digests) == len(variants) + 1
    assert base.replication != variants[-1].replication and base.layout != variants[-1].layout


def test_the_targets_namespace_does_not_name_a_part():
    """A cache with a draft writes the target's objects under the digest a cache without one uses."""
    base = u.UnifiedNamespace("model-a", "bfloat16", 64, SEED_GRID)
    assert "part" not in base.describe()
    assert dataclasses.replace(base, part="draft").describe()["part"] == "draft"


def test_a_name_says_what_it_holds_never_who_wrote_it():
    ns = u.UnifiedNamespace("m", "bfloat16", 64, SEED_GRID)
    key = ns.object_key(PAGE_HASH, SEED_GRID.cells[1])
    assert key == f"{PAGE_HASH.hex()}_{ns.digest}_L30-59_H0"
    assert "tp" not in key and "pp" not in key


def test_ragged_last_layer_range_is_one_span():
    geo = u.KVGeometry(num_layers=5, num_kv_heads=2, head_dim=4)
    grid = u.Grid(geo, layer_partition=2, head_partition=2)
    assert grid.layer_ranges == (range(0, 2), range(2, 4), range(4, 5))
    spans = u.reads(grid, u.shard_of(geo, 1, 0, 1, 0), 16, 2)
    last = spans[-1]
    assert last.cell.suffix == "L4-4_H0" and (last.offset, last.length) == (0, grid.layer_bytes(16, 2))


def test_mla_has_no_head_groups_and_every_tp_rank_reads_the_same_objects():
    geo = u.KVGeometry(num_layers=4, num_kv_heads=4, head_dim=80, latent=True)
    grid = u.Grid(geo, layer_partition=2)
    assert [c.suffix for c in grid.cells] == ["L0-1", "L2-3"]
    for tp in range(2):
        assert [s.cell.suffix for s in u.reads(grid, u.shard_of(geo, 2, tp, 1, 0), 16, 2)] == ["L0-1", "L2-3"]
    assert grid.layer_bytes(16, 2) == 80 * 16 * 2


def test_misaligned_layers_are_refused_naming_the_boundary():
    geo = u.KVGeometry(num_layers=4, num_kv_heads=2, head_dim=4)
    grid = u.Grid(geo, layer_partition=4, head_partition=1)
    with pytest.raises(UserError, match=r"ends at layer 2, inside the storage layer range L0-3 .*layer-partition 4"):
        u.check_aligned(grid, u.shard_of(geo, 1, 0, 2, 0), "PP rank 0")


def test_misaligned_heads_are_refused_naming_the_boundary():
    with pytest.raises(UserError, match=r"heads end at head 1, inside head group H0 = heads 0-1 .*head-partition 2"):
        u.check_aligned(SEED_GRID, u.shard_of(SEED, 8, 0, 1, 0))
    with pytest.raises(UserError, match="cut head group H0"):
        u.reads(SEED_GRID, u.shard_of(SEED, 8, 0, 1, 0), 64, 2)


def test_a_grid_the_model_cannot_hold_is_refused():
    with pytest.raises(UserError, match="head-partition 3 must divide the model's 8 KV heads"):
        u.Grid(SEED, 30, 3)
    with pytest.raises(UserError, match="layer-partition must be in 1..60"):
        u.Grid(SEED, 61, 2)


@st.composite
def topologies(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    geo = u.KVGeometry(draw(st.integers(1, 24)), heads, 2, latent=draw(st.booleans()))
    grid = u.Grid(
        geo, draw(st.integers(1, geo.num_layers)), draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    )
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if heads % t == 0]))
    pp = draw(st.integers(1, geo.num_layers))
    return grid, tp, pp


def _aligned(grid, tp, pp) -> bool:
    try:
        for t in range(tp):
            for p in range(pp):
                u.check_aligned(grid, u.shard_of(grid.geometry, tp, t, pp, p))
    except UserError:
        return False
    return True


@given(topologies(), st.integers(1, 8), st.sampled_from([1, 2, 4]))
def test_spans_tile_each_rank_page_and_the_grid(topology, page_size, itemsize):
    """Any topology: a rank's spans fill its host page exactly once, each within its object; over
    every rank every layer of every head group is read; an aligned topology writes every cell once
    (MLA: once per TP rank, the election is elsewhere) and each rank reads exactly what it writes."""
    grid, tp, pp = topology
    geo = grid.geometry
    covered = set()
    for t in range(tp):
        for p in range(pp):
            shard = u.shard_of(geo, tp, t, pp, p)
            if not geo.latent and any(
                not set(grid.group_heads(g)) <= set(shard.heads) and set(grid.group_heads(g)) & set(shard.heads)
                for g in grid.groups
            ):
                continue  # a rank that cuts a head group reads nothing (refused); covered elsewhere
            spans = u.reads(grid, shard, page_size, itemsize)
            lb = grid.layer_bytes(page_size, itemsize)
            ends = sorted((s.local_offset, s.local_offset + s.length) for s in spans)
            assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
            assert ends[-1][1] == u.local_page_bytes(grid, shard, page_size, itemsize)
            for s in spans:
                assert s.length == len(s.layers) * lb and s.offset + s.length <= len(s.cell.layers) * lb
                covered |= {(layer, s.cell.group) for layer in s.layers}
            if _aligned(grid, tp, pp):
                assert [s.cell for s in spans] == u.writes(grid, shard)
                assert all(s.offset == 0 and s.layers == s.cell.layers for s in spans)
    if _aligned(grid, tp, pp) or geo.latent:
        assert covered == {(layer, g) for layer in range(geo.num_layers) for g in grid.groups}
