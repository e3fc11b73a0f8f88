"""A draft model's proposals (docs/DESIGN.md, "speculative decoding"): the `Proposer` of `--speculative-algorithm
draft`, its state in pools of its own beside the target's.

Before the target's pass of a step:

1. Catch-up: the draft computes a decode request's rows it lags behind: the prompt the target
   prefilled in earlier steps (the draft catches up on it after the first token, which keeps the draft
   out of the TTFT), a cached prefix whose draft state was not restored (recomputed, and counted), a
   last accepted token. At most `catch_up_limit` rows per request and step; a request still behind
   gets no proposals. Its last row gives the draft's first proposal. The scheduler shares a prompt
   through the tree only once every pool holds it (`KVHandle.valid_len`), so a page in the tree always
   holds both models' state. The draft computes a prompt in its own step where a later one may not
   come (the first token is also the last), or where pages of its cached prefix lack the draft's
   state (not restored): those are in the tree already, and must be whole before another request
   reads them.
2. Proposals: K-1 more one-row draft steps (greedy), batched over the decode requests. The verify
   step's `KVHandle.truncate` rolls the draft's rejected rows back with the target's.

On several ranks (docs/DESIGN.md, "Speculative decoding on every topology") every rank runs the draft
(hicache/spec/build.py), so each computes the same proposals.

An MTP head (docs/DESIGN.md, "Speculative decoding: an MTP head") reads the target's hidden states: the
target's pass writes them into the head's pool rows (`target_sink`), the catch-up computes a row only once
the target has computed the one before it (a prompt whose first token is its last: after the target's
pass, in the same step, `after_target`), and its proposal rows after the first read the head's own output
and are not kept (the next catch-up recomputes the accepted ones from the target's hidden states). Under
PP the last stage sends those hidden states back to the earlier stages after the target's pass, so every
stage's copy of the head reads the same rows (`_store_target_hidden`). The draft's load events are the
target's (a layer's event covers both models' copies, hicache/mem/host_group.py).
"""

from __future__ import annotations

import torch

from hicache.mem.host_group import draft_event_layer
from hicache.model.batch import ForwardBatch
from hicache.scheduler.model_runner import ModelRunner, WorkItem
from hicache.spec.proposer import HiddenSink, LayerHook, tokens_left


class DraftProposer:
    def __init__(self, target: ModelRunner, draft: ModelRunner, context_length: int, catch_up_limit: int) -> None:
        self.target = target
        self.draft = draft
        self.context_length = context_length
        self.catch_up_limit = catch_up_limit
        self.recomputed_tokens = 0
        self._target_layers = target.model.num_local_layers
        # An MTP head reads the target's hidden states, and its proposals its own (hicache/model/families/mtp.py).
        self._chains_hidden = draft.model.reads_target_hidden
        self.target_sink: HiddenSink | None = self._store_target_hidden if self._chains_hidden else None

    def _left(self, item: WorkItem) -> int:
        return tokens_left(item.req, self.context_length)

    def _budget(self, item: WorkItem, limit: int) -> int:
        """Proposals for a decode item this step: its limit, none while the draft is still catching up."""
        behind = item.end - (item.req.kv.draft_len or 0)
        return 0 if behind > self.catch_up_limit else limit

    def propose(
        self, work: list[WorkItem], decoding: list[WorkItem], limits: list[int], before_layer: LayerHook | None
    ) -> list[list[int]]:
        """The draft's catch-up, then its proposals for the decode items."""
        budgets = [self._budget(item, limit) for item, limit in zip(decoding, limits)]
        hook = self._draft_hook(before_layer)
        wants_proposal = {id(item) for item, k in zip(decoding, budgets) if k > 0}
        catch_up = []
        for item in work:
            kv = item.req.kv
            assert kv.draft_len is not None, "speculative decoding needs a cache that tracks the draft"
            restored = kv.draft_len >= kv.cached.total
            if item.req.in_prefill and self._left(item) > 1 and restored:
                continue  # later, from its first decode step on
            if item.req.in_prefill and self._chains_hidden and self._left(item) <= 1:
                continue  # after the target's pass (`after_target`)
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

    def after_target(self, work: list[WorkItem], target_work: list[WorkItem], before_layer: LayerHook | None) -> None:
        """An MTP head's share of the target's pass: on a stage before the last, the hidden states the last
        stage sent back into its pool; then the prompts that end in this step."""
        if not self._chains_hidden:
            return
        if not self.target.link.pctx.is_last_stage:  # the last stage's sink sends them: the head here reads them too
            self._store_target_hidden(self.target.build(target_work), None)
        self._finish_prompts(work, self._draft_hook(before_layer))

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

    def _catch_up(self, item: WorkItem, end: int, logit_rows: int) -> WorkItem:
        """The draft's rows of `item`'s sequence it lags behind, up to `end`."""
        kv = item.req.kv
        # Rows over the cached prefix: its draft state was not restored with the target's.
        self.recomputed_tokens += max(0, min(end, kv.cached.total) - kv.draft_len)
        return WorkItem(item.req, kv.draft_len, end, logit_rows=logit_rows)

    def _finish_prompts(self, work: list[WorkItem], hook: LayerHook | None) -> None:
        """An MTP head's rows of the prompt chunks whose first token is also their last, once the target's
        pass has written the hidden states they read: no later step would compute them, and the tree
        shares a prompt only once every pool holds it."""
        items = [self._catch_up(item, item.end, logit_rows=0)
                 for item in work if item.req.in_prefill and self._left(item) <= 1]  # fmt: skip
        if items:
            self._draft_forward(items, hook)
            for item in items:
                item.req.kv.advance_draft(item.end)
