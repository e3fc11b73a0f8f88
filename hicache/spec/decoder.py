"""One speculative step for the scheduler (docs/DESIGN.md, "speculative decoding": draft runner, verify,
rollback through the KV handle). It is the scheduler's `StepCompute` when speculation is on.

A step, for the scheduler's work (prefill chunks, and one decode row per running request):

1. Draft catch-up: the draft computes a decode request's rows it lags behind: the prompt the target
   prefilled in earlier steps (the draft catches up on it after the first token, which keeps the draft
   out of the TTFT), a cached prefix whose draft state was not restored (recomputed, and counted), a
   last accepted token. At most `catch_up_limit` rows per request and step; a request still behind
   gets no proposals. Its last row gives the draft's first proposal. The scheduler shares a prompt
   through the tree only once every pool holds it (`KVHandle.valid_len`), so a page in the tree always
   holds both models' state. The draft computes a prompt in its own step where a later one may not
   come (the first token is also the last), or where pages of its cached prefix lack the draft's
   state (not restored): those are in the tree already, and must be whole before another request
   reads them.
2. Proposals: K-1 more one-row draft steps (greedy), batched over the decode requests.
3. One target pass: the prefill chunks and, per decode request, a (K+1)-row verify item (its last
   token and the K proposals), logits on every row.
4. Verification (`_choices`, on the sampling rank): the request keeps the target's choices up to the
   first disagreement, sampling row by row and stopping there. Row i's logits are those a plain decode
   step would give after the first i proposals (batch invariance makes them bitwise equal), so the agreeing run is what
   plain greedy decoding would have emitted anyway and the target's choice after it is its next token:
   greedy output with speculation is the target's alone, token for token. The step's output tells the
   scheduler to advance the handle over the K+1 rows and truncate it to what was kept:
   `KVHandle.truncate` rolls back both models' rejected rows.

On several ranks (docs/DESIGN.md, "Speculative decoding on every topology") every rank runs the draft
(hicache/spec/build.py), so each computes the same proposals, and the first stage has them to embed
the verify rows. Only the sampling rank (last stage) has the target's logits: it decides what each
request keeps and shares it (hicache/parallel/pipeline.py, with a digest of the batch and its
proposals), and every rank applies the same decision (`accept`, recorded by the consensus checker).

An MTP head (docs/DESIGN.md, "Speculative decoding: an MTP head") reads the target's hidden states: the
target's pass writes them into the head's pool rows, the catch-up computes a row only once the target
has computed the one before it (a prompt whose first token is its last: after the target's pass, in the
same step), and its proposal rows after the first read the head's own output and are
not kept (the next catch-up recomputes the accepted ones from the target's hidden states). Under PP the
last stage sends those hidden states back to the earlier stages after the target's pass, so every
stage's copy of the head reads the same rows (`_store_target_hidden`).

Speculation is greedy-only: a sampling request takes K = 0 (its verify item is a plain decode row,
sampled as without speculation), as does a request with one token left. The draft's load events are
the target's (a layer's event covers both models' copies, hicache/mem/host_group.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hicache.cache import KVCache
from hicache.debug.consensus_checker import consensus_checked
from hicache.mem.host_group import draft_event_layer
from hicache.model.batch import ForwardBatch
from hicache.scheduler.model_runner import ModelRunner, StepOutput, WorkItem
from hicache.scheduler.request import Request, TokenLogprob
from hicache.scheduler.sampler import sample
from hicache.spec.stats import SpecStats

logger = logging.getLogger(__name__)

LayerHook = Callable[[int], None]


class SpeculativeDecoder:
    speculative = True

    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner,
        cache: KVCache,
        num_draft_tokens: int,
        context_length: int,
        catch_up_limit: int,
    ) -> None:
        self.target = target
        self.draft = draft
        self.cache = cache
        self.num_draft_tokens = num_draft_tokens
        self.context_length = context_length
        self.catch_up_limit = catch_up_limit
        self._target_layers = target.model.num_local_layers
        # An MTP head reads the target's hidden states, and its proposals its own (hicache/model/families/mtp.py).
        self._chains_hidden = draft.model.reads_target_hidden
        self._stats = SpecStats()

    def stats(self) -> SpecStats:
        return SpecStats(**vars(self._stats))

    def _left(self, req: Request) -> int:
        """Tokens `req` may still emit."""
        produced = len(req.output_ids)
        return min(req.max_new_tokens - produced, self.context_length - req.prompt_len - produced)

    def _budget(self, item: WorkItem) -> int:
        """Proposals for a decode item this step: K, fewer near its end (a step emits at most K+1
        tokens), none when it samples or when the draft is still catching up."""
        req = item.req
        behind = item.end - (req.kv.draft_len or 0)
        if req.params.temperature != 0.0 or behind > self.catch_up_limit:
            return 0
        return max(0, min(self.num_draft_tokens, self._left(req) - 1))

    def step(self, work: list[WorkItem], before_layer: LayerHook | None) -> list[StepOutput]:
        decoding = [item for item in work if not item.req.in_prefill]
        budgets = [self._budget(item) for item in decoding]
        for item, k in zip(decoding, budgets):
            self.cache.extend(item.req.kv, item.end + k)  # the verify rows' pages, out of its reservation
        proposals = self._propose(work, decoding, budgets, self._draft_hook(before_layer))
        verify = {
            id(item): WorkItem(item.req, item.start, item.end + k, tuple(p), logit_rows=k + 1)
            for item, k, p in zip(decoding, budgets, proposals)
        }
        target_work = [verify.get(id(item), item) for item in work]
        sink = self._store_target_hidden if self._chains_hidden else None
        logits = self.target.forward(target_work, before_layer, sink)  # None on a stage before the last
        link = self.target.link
        if self._chains_hidden:
            if not link.pctx.is_last_stage:  # the last stage's sink sends them: the head here reads them too
                self._store_target_hidden(self.target.build(target_work), None)
            self._finish_prompts(work, self._draft_hook(before_layer))
        choices = self._choices(work, target_work, logits) if link.samples_here else None
        # Its digest covers the proposals: a rank whose draft proposed otherwise finds out here.
        digest = hash(tuple((done.req.rid, done.start, done.end, done.draft) for done in target_work))
        return self.accept(work, target_work, link.share_samples(choices, digest))

    def _store_target_hidden(self, batch: ForwardBatch, hidden: torch.Tensor | None) -> None:
        """The target's final hidden states of `batch`'s rows into the head's pool, on every stage: the
        last stage computed them (`hidden`), and under PP sends them to the earlier ones (None there)."""
        target = self.target.model
        hidden = self.target.link.share_final_hidden(
            hidden, batch.num_tokens, target.cfg.hidden_size, target.dtype, self.draft.pool.device
        )
        self.draft.model.store_target_hidden(self.draft.pool, batch.out_slots, hidden)

    def _draft_forward(
        self, items: list[WorkItem], hook: LayerHook | None, carried: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's logits, and for an MTP head its output hidden states of the same rows (what its
        next proposal reads)."""
        if not self._chains_hidden:
            logits = self.draft.forward(items, hook)
            assert logits is not None
            return logits, None
        out: list[torch.Tensor] = []
        logits = self.draft.forward(items, hook, lambda batch, h: out.append(h[batch.logit_rows]), carried)
        assert logits is not None
        return logits, out[0]

    def _draft_hook(self, before_layer: LayerHook | None) -> LayerHook | None:
        if before_layer is None:
            return None
        target_layers = self._target_layers
        return lambda layer: before_layer(draft_event_layer(layer, target_layers))

    def _propose(
        self, work: list[WorkItem], decoding: list[WorkItem], budgets: list[int], hook: LayerHook | None
    ) -> list[list[int]]:
        """The draft's catch-up, then its proposals for the decode items."""
        wants_proposal = {id(item) for item, k in zip(decoding, budgets) if k > 0}
        catch_up = []
        for item in work:
            kv = item.req.kv
            assert kv.draft_len is not None, "speculative decoding needs a cache that tracks the draft"
            restored = kv.draft_len >= kv.cached.total
            if item.req.in_prefill and self._left(item.req) > 1 and restored:
                continue  # later, from its first decode step on
            if item.req.in_prefill and self._chains_hidden and self._left(item.req) <= 1:
                continue  # after the target's pass (`_finish_prompts`)
            end = min(item.end, kv.draft_len + self.catch_up_limit)
            if self._chains_hidden:  # only rows whose predecessor's hidden state the target has computed
                end = min(end, kv.kv_len + 1)  # above draft_len: the head never runs ahead of the target
            catch_up.append(self._catch_up(item, end, logit_rows=int(id(item) in wants_proposal)))
        if not catch_up:
            return [[] for _ in budgets]
        logits, hidden = self._draft_forward(catch_up, hook)
        for item in catch_up:
            item.req.kv.advance_draft(item.end)
        first = iter(int(torch.argmax(row)) for row in logits)
        proposals = [[next(first)] if k > 0 else [] for k in budgets]
        # Per proposing item, the MTP head's output hidden state of its last row.
        outputs = dict(zip([i for i, k in enumerate(budgets) if k > 0], hidden if hidden is not None else []))
        for j in range(1, max(budgets, default=0)):
            active = [i for i, k in enumerate(budgets) if k > j]
            steps = [
                WorkItem(decoding[i].req, decoding[i].end + j - 1, decoding[i].end + j, tuple(proposals[i]))
                for i in active
            ]
            carried = torch.stack([outputs[i] for i in active]) if self._chains_hidden else None
            logits, hidden = self._draft_forward(steps, hook, carried)
            for n, (i, step, row) in enumerate(zip(active, steps, logits)):
                proposals[i].append(int(torch.argmax(row)))
                if hidden is None:
                    step.req.kv.advance_draft(step.end)
                else:
                    # Not kept: a row made from the head's own hidden state, not the target's. The next
                    # catch-up recomputes the accepted ones from the target's, so a token's row is the
                    # same whether it came as a proposal or in a prompt (after a hit too).
                    outputs[i] = hidden[n]
        return proposals

    def _catch_up(self, item: WorkItem, end: int, logit_rows: int) -> WorkItem:
        """The draft's rows of `item`'s sequence it lags behind, up to `end`."""
        kv = item.req.kv
        # Rows over the cached prefix: its draft state was not restored with the target's.
        self._stats.draft_recomputed_tokens += max(0, min(end, kv.cached.total) - kv.draft_len)
        return WorkItem(item.req, kv.draft_len, end, logit_rows=logit_rows)

    def _finish_prompts(self, work: list[WorkItem], hook: LayerHook | None) -> None:
        """An MTP head's rows of the prompt chunks whose first token is also their last, once the target's
        pass has written the hidden states they read: no later step would compute them, and the tree
        shares a prompt only once every pool holds it."""
        items = [self._catch_up(item, item.end, logit_rows=0)
                 for item in work if item.req.in_prefill and self._left(item.req) <= 1]  # fmt: skip
        if items:
            self._draft_forward(items, hook)
            for item in items:
                item.req.kv.advance_draft(item.end)

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
