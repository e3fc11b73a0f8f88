"""The forward pass's messages between ranks: hidden states from one pipeline stage to the next, and the
sampled tokens from the one rank that samples (last stage, first TP rank) to every rank, so every
scheduler appends the same tokens. With an MTP head under PP, also the target's final hidden states
from the last stage back to the earlier ones, whose copies of the head read them (docs/DESIGN.md,
"Speculative decoding: an MTP head").

Batch metadata (which requests, which token ranges, which slots) is never sent: every rank derives it
from identical scheduler state. The sampled-token message carries a digest of the batch it was sampled
for, so a rank whose batch differs finds out here instead of computing on garbage. At one rank both
messages are the identity.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from hicache.parallel.divergence import RankDivergenceError
from hicache.parallel.parallel import ParallelContext


class StageLink:
    def __init__(self, pctx: ParallelContext) -> None:
        self.pctx = pctx

    @property
    def samples_here(self) -> bool:
        return self.pctx.rank == self.pctx.sampling_rank

    def recv_hidden(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The previous stage's output for this step's tokens (None on the first stage: it embeds)."""
        if self.pctx.is_first_stage:
            return None
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(hidden, src=self.pctx.prev_stage_rank, group=self.pctx.pp_group)
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), dst=self.pctx.next_stage_rank, group=self.pctx.pp_group)

    def share_final_hidden(
        self, hidden: torch.Tensor | None, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The last stage's final hidden states of this step's tokens on every stage of this rank's
        pipeline (the last stage passes them, the others None): one broadcast down the TP index's
        stages, the size of one stage-to-stage message."""
        if self.pctx.pp_size == 1:
            assert hidden is not None
            return hidden
        src = self.pctx.rank_of(self.pctx.pp_size - 1, self.pctx.tp_rank)
        if self.pctx.is_last_stage:
            assert hidden is not None
            hidden = hidden.contiguous()
        else:
            hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.broadcast(hidden, src=src, group=self.pctx.pp_group)
        return hidden

    def share_samples(self, samples: Sequence[Any] | None, batch_digest: int) -> list[Any]:
        """The sampling rank's `samples` on every rank (others pass None)."""
        if self.pctx.world_size == 1:
            assert samples is not None
            return list(samples)
        message: list[Any] = [samples, batch_digest] if self.samples_here else [None, None]
        dist.broadcast_object_list(message, src=self.pctx.sampling_rank, group=self.pctx.world_group)
        if message[1] != batch_digest:
            raise RankDivergenceError(
                f"rank {self.pctx.rank} ({self.pctx.suffix}) ran a different batch than the sampling rank "
                f"{self.pctx.sampling_rank}: their schedulers diverged"
            )
        return list(message[0])
