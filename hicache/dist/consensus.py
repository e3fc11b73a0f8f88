"""Rank agreement: the one interface through which every consumer of asynchronous results (backup and
load ACKs, storage hit lengths, prefetch progress) decides how much to consume.

Each call names what it agrees on and passes this rank's view (ready counts, hit lengths); every rank
gets the same answer, the element-wise minimum over the ranks that must agree, so ranks whose copies
finish at different times still apply the same cache operations at the same logical point. At one rank
every agreement is the identity. Every rank must call at every check, even with nothing ready: an
early return on an empty queue would leave the other ranks waiting in the collective.
"""

from __future__ import annotations

from typing import Sequence

from hicache.dist.parallel import ParallelContext


class Consensus:
    def __init__(self, pctx: ParallelContext) -> None:
        self.pctx = pctx

    def agree_min(self, name: str, values: Sequence[int]) -> list[int]:
        """Element-wise MIN of `values` over the ranks; identical on every rank."""
        if self.pctx.world_size == 1:
            return list(values)
        raise NotImplementedError("multi-rank agreement arrives with tensor/pipeline parallel ranks")
