"""P/D disaggregation: ranks agree on transfer outcomes before acting on them.

Every rank of a prefill or decode deployment moves its own cells of each request's KV (each prefill rank
to every decode rank it overlaps, cells.py), and those transfers finish at different times on different
ranks. The schedulers act on them in lockstep, so once a step every rank takes the element-wise MIN of
its view (FAILED < pending < done; KVPoll orders them so) over every rank, on the world's gloo group: a
request moves on only once it is done everywhere, and fails everywhere if it failed anywhere. Values
that must be equal everywhere (the decode_prefix_len each rank computed) are checked with MIN of x and
-x.

The pending lists are replicated (requests arrive in the same order on every rank), so every rank calls
this at the same points with lists of the same length, and all skip it together when empty. At one rank
it is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hicache.parallel.divergence import RankDivergenceError
from hicache.parallel.parallel import ParallelContext


def agree_min(pctx: ParallelContext, values: Sequence[int], equal: Sequence[int] = ()) -> list[int]:
    """Element-wise MIN of `values` over every rank; `equal` must be the same on every rank
    (RankDivergenceError otherwise)."""
    if pctx.world_size == 1 or not (values or equal):
        return list(values)
    n = len(values)
    tensor = torch.tensor([*values, *equal, *(-x for x in equal)], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=pctx.world_group)
    out = tensor.tolist()
    low, high = out[n : n + len(equal)], [-x for x in out[n + len(equal) :]]
    if low != high:
        raise RankDivergenceError(
            f"P/D ranks disagree on values that must be equal (rank {pctx.rank}, {pctx.suffix}): "
            f"lowest {low}, highest {high}"
        )
    return out[:n]
