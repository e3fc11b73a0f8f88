"""One speculative step for the scheduler (docs/DESIGN.md, "speculative decoding": proposals, verify,
rollback through the KV handle). It is the scheduler's `StepCompute` when speculation is on.

A step, for the scheduler's work (prefill chunks, and one decode row per running request):

1. Proposals: the proposer (hicache/spec/proposer.py: a draft model, or the request's own context)
   proposes up to K tokens per decode request, fewer near its end (a step emits at most K+1 tokens),
   none for a sampling request.
2. One target pass: the prefill chunks and, per decode request, a (K+1)-row verify item (its last
   token and the K proposals), logits on every row.
3. Verification (`_choices`, on the sampling rank): the request keeps the target's choices up to the
   first disagreement, sampling row by row and stopping there. Row i's logits are those a plain decode
   step would give after the first i proposals (batch invariance makes them bitwise equal), so the agreeing run is what
   plain greedy decoding would have emitted anyway and the target's choice after it is its next token:
   greedy output with speculation is the target's alone, token for token, whatever proposed. The step's
   output tells the scheduler to advance the handle over the K+1 rows and truncate it to what was kept:
   `KVHandle.truncate` rolls back the rejected rows (a draft's with the target's).

On several ranks (docs/DESIGN.md, "Speculative decoding on every topology") every rank runs the proposer,
so each has the same proposals, and the first stage has them to embed the verify rows. Only the sampling
rank (last stage) has the target's logits: it decides what each request keeps and shares it
(hicache/parallel/pipeline.py, with a digest of the batch and its proposals), and every rank applies the
same decision (`accept`, recorded by the consensus checker).

Speculation is greedy-only: a sampling request takes K = 0 (its verify item is a plain decode row,
sampled as without speculation), as does a request with one token left.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hicache.cache import KVCache
from hicache.debug.consensus_checker import consensus_checked
from hicache.scheduler.model_runner import ModelRunner, StepOutput, WorkItem
from hicache.scheduler.request import TokenLogprob
from hicache.scheduler.sampler import sample
from hicache.spec.proposer import LayerHook, Proposer, tokens_left
from hicache.spec.stats import SpecStats


class SpeculativeDecoder:
    speculative = True

    def __init__(
        self, target: ModelRunner, proposer: Proposer, cache: KVCache, num_draft_tokens: int, context_length: int
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.cache = cache
        self.num_draft_tokens = num_draft_tokens
        self.context_length = context_length
        self._stats = SpecStats()

    def stats(self) -> SpecStats:
        return replace(self._stats, draft_recomputed_tokens=self.proposer.recomputed_tokens)

    def _limit(self, item: WorkItem) -> int:
        """The most proposals a decode item may verify this step: K, fewer near its end, none when it samples."""
        req = item.req
        if req.params.temperature != 0.0:
            return 0
        return max(0, min(self.num_draft_tokens, tokens_left(req, self.context_length) - 1))

    def step(self, work: list[WorkItem], before_layer: LayerHook | None) -> list[StepOutput]:
        decoding = [item for item in work if not item.req.in_prefill]
        limits = [self._limit(item) for item in decoding]
        for item, k in zip(decoding, limits):
            self.cache.extend(item.req.kv, item.end + k)  # the verify rows' pages, out of its reservation
        proposals = self.proposer.propose(work, decoding, limits, before_layer)
        verify = {
            id(item): WorkItem(item.req, item.start, item.end + len(p), tuple(p), logit_rows=len(p) + 1)
            for item, p in zip(decoding, proposals)
        }
        target_work = [verify.get(id(item), item) for item in work]
        logits = self.target.forward(target_work, before_layer, self.proposer.target_sink)  # None before the last stage
        self.proposer.after_target(work, target_work, before_layer)
        link = self.target.link
        choices = self._choices(work, target_work, logits) if link.samples_here else None
        # Its digest covers the proposals: a rank that proposed otherwise finds out here.
        digest = hash(tuple((done.req.rid, done.start, done.end, done.draft) for done in target_work))
        return self.accept(work, target_work, link.share_samples(choices, digest))

    def _choices(
        self, work: list[WorkItem], target_work: list[WorkItem], logits: torch.Tensor | None
    ) -> list[list[tuple[int, TokenLogprob | None]]]:
        """On the sampling rank: per item, the tokens the target chooses. A verify item's run of the
        target's choices stops at its first disagreement with the proposals: the target's choice there
        is its next token, and the proposals after it are rejected."""
        assert logits is not None  # the sampling rank is on the last pipeline stage
        out, row = [], 0
        for item, done in zip(work, target_work):
            rows = logits[row : row + done.num_logit_rows]
            row += done.num_logit_rows
            if done is item:  # a prefill chunk: the plain step's sample, if it reached its prompt's end
                out.append([sample(rows[0], item.req)] if len(rows) else [])
                continue
            choices = []
            for i in range(len(done.draft) + 1):
                choices.append(sample(rows[i], item.req))
                if i < len(done.draft) and choices[-1][0] != done.draft[i]:
                    break
            out.append(choices)
        return out

    @consensus_checked(
        params={"proposals": lambda ns: [[done.req.rid, *done.draft] for done in ns["target_work"] if done.draft]},
        results={"kept": lambda ns: [[out.kept, len(out.tokens)] for out in ns["result"]]},
    )
    def accept(
        self, work: list[WorkItem], target_work: list[WorkItem], choices: list[list[tuple[int, TokenLogprob | None]]]
    ) -> list[StepOutput]:
        """Every rank's outputs from the sampling rank's `choices`: each verify item keeps its accepted
        proposals and the target's next token, and the handle truncates its rejected rows."""
        outputs = []
        for item, done, chosen in zip(work, target_work, choices):
            if done is item:
                outputs.append(StepOutput(item.end, item.end, chosen))
                continue
            req, proposed, accepted = item.req, done.draft, len(chosen) - 1
            if proposed:
                req.spec_proposed += len(proposed)
                req.spec_accepted += accepted
                self._stats.proposed_tokens += len(proposed)
                self._stats.accepted_tokens += accepted
                self._stats.verify_steps += 1
            outputs.append(StepOutput(done.end, item.end + accepted, chosen))
        return outputs
