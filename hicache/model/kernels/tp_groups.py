"""Tensor parallelism that gives every TP size the same bits: projections cut into fixed groups.

A TP rank computes some output columns of the column-parallel projections (q/k/v, gate/up, MLA's q and
kv_b) and a partial sum over a slice of the reduced dimension of the row-parallel ones (o_proj,
down_proj). Both can change a result's bits with the TP size: a GEMM kernel picks its blocking from the
call's shape, and a sum cut into t partials rounds in another order for every t. So at every TP size
each such weight is cut into the same G groups, G being the largest TP size the model can be split
into (`tp_group_count`), and a rank runs the G/t groups it holds:

- a column group is one call of the same weight and shape whether one rank runs all G or G ranks one
  each, so its outputs are the same bits at every TP size;
- a row group's partial product likewise, and the G partials are added in float32 in one pairwise
  order that depends on G alone (`pairwise_sum`), then rounded to the activation dtype once.

Where a rank's G/t groups are one subtree of that order (G/t a power of two) the rank adds its own
subtree and the ranks then add theirs in the same order: two ranks by an all-reduce (a + b is b + a
exactly, whatever the algorithm's chunking), more gathered and added in rank order's tree. Otherwise
every partial is gathered and the whole tree added on each rank. Either way TP1, TP2, ... TPG compute
the same sums of the same operands in the same order. What still differs between topologies is the
number of threads a rank runs: the start-up self-check compares the model at its thread count with
one thread (invariance.py).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

import torch
import torch.distributed

from hicache.model.kernels import ops
from hicache.parallel.parallel import ParallelContext


class MakeLinear(Protocol):
    """Turns a checkpoint weight (sliced for this rank) into a batch-invariant matmul (build.LinearFactory)."""

    def __call__(self, weight: Any) -> ops.Linear: ...

    def stacked(self, weights: list[Any]) -> ops.Linear | None:
        """One matmul of the weights stacked by rows, where that gives each one's outputs bit for bit."""


def tp_group_count(split_heads: int, intermediate_size: int) -> int:
    """G: the largest TP size the model splits into, the heads TP divides (KV heads, or MLA's heads)
    and the MLP's columns alike. Every valid TP size divides it."""
    return math.gcd(split_heads, intermediate_size)


def pairwise_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adjacent pairs added level by level, an odd last part carried up: an order fixed by the count."""
    level = list(parts)
    while len(level) > 1:
        paired = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = paired + level[-1:] if len(level) % 2 else paired
    return level[0]


def tp_reduce(partials: list[torch.Tensor], pctx: ParallelContext) -> torch.Tensor:
    """The pairwise sum of every TP rank's group partials (this rank's `partials`, float32, in group
    order), the same bits on every rank and at every TP size."""
    t = pctx.tp_size
    if t == 1 or _one_subtree(len(partials)):
        return reduce_subtrees(pairwise_sum(partials), pctx)
    mine = torch.stack(partials)
    everyone = [torch.empty_like(mine) for _ in range(t)]
    torch.distributed.all_gather(everyone, mine, group=pctx.tp_group)
    return pairwise_sum([partial for rank in everyone for partial in rank.unbind(0)])


def _one_subtree(per_rank: int) -> bool:
    """Whether a rank's groups are one subtree of the pairwise order (their count a power of two)."""
    return per_rank & (per_rank - 1) == 0


def reduce_subtrees(local: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """`tp_reduce` given this rank's own pairwise sum `local`, where its groups are one subtree of the order
    (or TP is 1): the ranks' subtrees added in the order's tree."""
    t = pctx.tp_size
    if t == 1:
        return local
    if t == 2:
        torch.distributed.all_reduce(local, group=pctx.tp_group)
        return local
    subtrees = [torch.empty_like(local) for _ in range(t)]
    torch.distributed.all_gather(subtrees, local, group=pctx.tp_group)
    return pairwise_sum(subtrees)


class ColumnGroups:
    """A column-parallel projection as this rank's groups: `weights` holds each group's rows. The groups
    run as one call where the calibration measured that one call gives every group's outputs bit for
    bit as the group's own call (the same bits as on a rank holding one group), else one call each."""

    def __init__(self, weights: list[Any], make_linear: MakeLinear) -> None:
        self.count = len(weights)
        self.fused = make_linear.stacked(weights) if self.count > 1 else None
        self.groups = [make_linear(w) for w in weights] if self.fused is None else []

    @property
    def plan(self) -> ops.LinearPlan:
        return self.calls[0].plan

    @property
    def calls(self) -> list[ops.Linear]:
        """The linears a call runs, in order: the fused one, or one a group."""
        return [self.fused] if self.fused is not None else self.groups

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, groups, group outputs]."""
        if self.fused is not None:
            return self.fused(x).view(x.shape[0], self.count, -1)
        outs = [g(x) for g in self.groups]
        return torch.stack(outs, dim=1) if len(outs) > 1 else outs[0].unsqueeze(1)


class RowGroups:
    """A row-parallel projection summed over TP: `weights` holds each of this rank's groups' columns
    of the reduced dimension; the call returns the sum over every group of every rank."""

    def __init__(self, weights: list[Any], make_linear: MakeLinear, pctx: ParallelContext) -> None:
        self.groups = [make_linear(w) for w in weights]
        self.pctx = pctx
        # One kernel call for the rank's partials and their sum, where the kernel has one (same bits).
        self.summed = ops.linear_sum(self.groups) if pctx.tp_size == 1 or _one_subtree(len(self.groups)) else None

    @property
    def plan(self) -> ops.LinearPlan:
        return self.groups[0].plan

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[T, groups * group inputs] -> [T, out] in x's dtype."""
        if self.summed is not None and x.dim() == 2:
            return reduce_subtrees(self.summed(x), self.pctx).to(x.dtype)
        width = self.groups[0].in_features
        partials = [g(x[:, i * width : (i + 1) * width]).float() for i, g in enumerate(self.groups)]
        return tp_reduce(partials, self.pctx).to(x.dtype)


def group_slices(total: int, groups: int, first: int, last: int) -> list[slice]:
    """The slices of a dimension of `total` cut into `groups` equal groups, for groups first..last-1."""
    width = total // groups
    return [slice(g * width, (g + 1) * width) for g in range(first, last)]
