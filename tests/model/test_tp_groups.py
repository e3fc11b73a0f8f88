"""The fixed sum order that makes every TP size compute the same bits (hicache/model/kernels/tp_groups.py).

- the pairwise order over G partials is the order of its subtrees: a rank that adds its block of G/t
  partials (G/t a power of two) and then adds the ranks' results in the same order computes exactly the
  whole tree's sum, for every G and t (a property of the order, checked on symbolic sums);
- on real TP ranks (gloo on loopback, 2, 3 and 4 of them) `tp_reduce` gives every rank the bits one
  rank gets adding all G partials itself, for group counts whose blocks are subtrees and for those
  whose are not (6 groups over 2 ranks: every partial is gathered), on operands where any other order
  of the same additions gives other bits.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from hicache.model.kernels.tp_groups import pairwise_sum, tp_reduce
from hicache.parallel.parallel import Mesh, ParallelContext
from tests.parallel.ranks import outcomes_of, report


class Sum(tuple):
    """A symbolic sum: `a + b` is the pair (a, b), so equal trees mean the same additions in one order."""

    def __add__(self, other: "Sum") -> "Sum":
        return Sum((self, other))


def leaf(i: int) -> Sum:
    return Sum((i,))


@given(st.integers(0, 4), st.integers(1, 12))
def test_the_order_of_blocks_that_are_subtrees_is_the_whole_order(log_block: int, ranks: int) -> None:
    block = 2**log_block
    leaves = [leaf(i) for i in range(block * ranks)]
    per_rank = [pairwise_sum(leaves[r * block : (r + 1) * block]) for r in range(ranks)]
    assert pairwise_sum(per_rank) == pairwise_sum(leaves)


def test_the_order_is_adjacent_pairs_level_by_level() -> None:
    a, b, c, d, e = (leaf(i) for i in range(5))
    assert pairwise_sum([a]) == a
    assert pairwise_sum([a, b, c]) == (a + b) + c
    assert pairwise_sum([a, b, c, d, e]) == ((a + b) + (c + d)) + e


def partial(group: int) -> torch.Tensor:
    """Group `group`'s float32 partial: magnitudes 2^-20..2^20 apart, so regrouping the additions
    changes the rounding of nearly every element."""
    gen = torch.Generator().manual_seed(group)
    return torch.randn(4, 64, generator=gen) * 2.0 ** torch.randint(-20, 21, (4, 64), generator=gen)


def right_fold(parts: list[torch.Tensor]) -> torch.Tensor:
    """a + (b + (c + ...)): another order of the same additions, for every count above two."""
    total = parts[-1]
    for p in reversed(parts[:-1]):
        total = p + total
    return total


GROUPS_BY_TP = {2: (2, 4, 6, 8), 3: (3, 6), 4: (4, 8)}


def _rank(rank: int, init: str, results, tp: int) -> None:
    timeout = timedelta(seconds=60)
    mesh = Mesh(tp=tp)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp, timeout=timeout)
    pctx = ParallelContext.create(rank, mesh, "gloo", timeout)
    sums = {}
    for groups in GROUPS_BY_TP[tp]:
        per = groups // tp
        sums[groups] = tp_reduce([partial(g) for g in range(rank * per, (rank + 1) * per)], pctx)
    report(rank, sums, pctx, results)


def _rank2(rank: int, init: str, results) -> None:
    _rank(rank, init, results, 2)


def _rank3(rank: int, init: str, results) -> None:
    _rank(rank, init, results, 3)


def _rank4(rank: int, init: str, results) -> None:
    _rank(rank, init, results, 4)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,target", [(2, _rank2), (3, _rank3), (4, _rank4)])
def test_every_tp_size_sums_the_groups_to_the_bits_of_one_rank(tp, target) -> None:
    outcomes = outcomes_of(target, tp)
    for groups in GROUPS_BY_TP[tp]:
        one_rank = pairwise_sum([partial(g) for g in range(groups)])
        for rank in range(tp):
            assert torch.equal(outcomes[rank][groups], one_rank), (tp, groups, rank)
        if groups > 2:  # the operands show another order: the test would see one
            assert not torch.equal(right_fold([partial(g) for g in range(groups)]), one_rank)
