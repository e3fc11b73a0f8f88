"""ParallelContext over named axes: the rank formula is a bijection between (pp, cp, tp) coordinates and
0..world-1, the groups of each axis partition the ranks into runs that differ in that axis only, and
the names other parts rely on (suffix, stage neighbours, the sampling rank, shard ranges) keep their
meaning at cp_size 1."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.parallel.parallel import AXES, Mesh, ParallelContext, split_range

meshes = st.builds(Mesh, pp=st.integers(1, 4), cp=st.integers(1, 3), tp=st.integers(1, 4))


def contexts(mesh: Mesh) -> list[ParallelContext]:
    return [
        ParallelContext(tp_size=mesh.tp, tp_rank=t, pp_size=mesh.pp, pp_rank=p, cp_size=mesh.cp, cp_rank=c)
        for p, c, t in itertools.product(range(mesh.pp), range(mesh.cp), range(mesh.tp))
    ]


@given(meshes)
def test_the_rank_formula_is_a_bijection(mesh):
    coords = list(itertools.product(range(mesh.pp), range(mesh.cp), range(mesh.tp)))
    ranks = [mesh.rank_of(pp=p, cp=c, tp=t) for p, c, t in coords]
    assert sorted(ranks) == list(range(mesh.world_size))
    for (p, c, t), rank in zip(coords, ranks):
        assert mesh.coords_of(rank) == {"pp": p, "cp": c, "tp": t}


@given(meshes, st.sampled_from(AXES))
def test_groups_of_an_axis_partition_the_ranks(mesh, axis):
    groups = mesh.groups(axis)
    members = [rank for group in groups for rank in group]
    assert sorted(members) == list(range(mesh.world_size))  # every rank exactly once
    assert len(groups) == mesh.world_size // mesh.size(axis)
    for group in groups:
        assert len(group) == mesh.size(axis)
        coords = [mesh.coords_of(rank) for rank in group]
        assert [c[axis] for c in coords] == list(range(mesh.size(axis)))  # ordered along the axis
        for other in AXES:
            if other != axis:
                assert len({c[other] for c in coords}) == 1  # and equal in every other axis


@given(meshes)
def test_each_rank_knows_its_place(mesh):
    for pctx in contexts(mesh):
        assert pctx.world_size == mesh.world_size
        assert pctx.mesh.coords_of(pctx.rank) == pctx.coords
        sampler = mesh.coords_of(pctx.sampling_rank)
        assert sampler == {"pp": mesh.pp - 1, "cp": 0, "tp": 0}
        if not pctx.is_first_stage:
            prev = mesh.coords_of(pctx.prev_stage_rank)
            assert prev == {**pctx.coords, "pp": pctx.pp_rank - 1}
        if not pctx.is_last_stage:
            assert mesh.coords_of(pctx.next_stage_rank) == {**pctx.coords, "pp": pctx.pp_rank + 1}


def test_tp_is_fastest_and_pp_slowest():
    """The layout of every earlier release: rank = pp_rank * tp_size + tp_rank at cp_size 1."""
    mesh = Mesh(pp=2, tp=3)
    assert [mesh.rank_of(pp=p, tp=t) for p in range(2) for t in range(3)] == list(range(6))
    assert mesh.groups("tp") == [[0, 1, 2], [3, 4, 5]]
    assert mesh.groups("pp") == [[0, 3], [1, 4], [2, 5]]
    assert mesh.groups("cp") == [[r] for r in range(6)]


def test_suffix_names_cp_only_when_it_is_used():
    assert ParallelContext(tp_size=2, tp_rank=1, pp_size=2, pp_rank=0).suffix == "tp1of2_pp0of2"
    assert ParallelContext(cp_size=2, cp_rank=1).suffix == "tp0of1_pp0of1_cp1of2"


def test_one_rank_has_no_groups_and_identity_collectives():
    pctx = ParallelContext()
    assert (pctx.rank, pctx.world_size, pctx.sampling_rank) == (0, 1, 0)
    assert pctx.is_first_stage and pctx.is_last_stage
    assert pctx.tp_group is pctx.tp_cpu_group is pctx.pp_group is pctx.pp_cpu_group is None
    assert pctx.layer_range(5) == (0, 5) and pctx.shard_range(8, "heads") == (0, 8)


def test_shards_and_layers_follow_tp_and_pp():
    pctx = ParallelContext(tp_size=2, tp_rank=1, pp_size=3, pp_rank=2)
    assert pctx.shard_range(8, "KV heads") == (4, 8)
    assert pctx.layer_range(7) == split_range(7, 3, 2) == (5, 7)
    with pytest.raises(ValueError, match="not divisible by tp_size=2"):
        pctx.shard_range(3, "KV heads")


def test_coordinates_outside_the_mesh_are_refused():
    with pytest.raises(ValueError, match="tp index 2 outside 0..1"):
        ParallelContext(tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="unknown parallel axis"):
        Mesh().size("dp")
