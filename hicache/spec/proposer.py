"""What proposes the tokens a speculative step verifies (docs/DESIGN.md, "speculative decoding"): the part of
the step before the target's pass. The decoder (decoder.py) verifies and accepts the proposals whoever made
them, so a draft model (draft_proposer.py) and the request's own context (ngram.py) share one verify path.

Every rank runs the proposer on the same inputs and must propose the same tokens: the first pipeline stage
embeds them, and the sampling rank's acceptance is shared under a digest of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from hicache.model.batch import ForwardBatch
from hicache.scheduler.model_runner import WorkItem
from hicache.scheduler.request import Request

LayerHook = Callable[[int], None]
HiddenSink = Callable[[ForwardBatch, torch.Tensor], None]


def tokens_left(req: Request, context_length: int) -> int:
    """Tokens `req` may still emit."""
    produced = len(req.output_ids)
    return min(req.max_new_tokens - produced, context_length - req.prompt_len - produced)


class Proposer(Protocol):
    # Takes the target's final hidden states of the rows it computes (what an MTP head reads); None: unused.
    target_sink: HiddenSink | None
    # Draft rows computed over a cached prefix whose draft state was not restored (SpecStats).
    recomputed_tokens: int

    def propose(
        self, work: list[WorkItem], decoding: list[WorkItem], limits: list[int], before_layer: LayerHook | None
    ) -> list[list[int]]:
        """Per item of `decoding` (the decode items of this step's `work`), at most its limit tokens to
        follow its known ones; the handles already have the pages of `limits` more rows."""

    def after_target(self, work: list[WorkItem], target_work: list[WorkItem], before_layer: LayerHook | None) -> None:
        """What the proposer computes once the target's pass over `target_work` (`work` with its verify
        items) has run."""
