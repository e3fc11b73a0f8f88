"""Turns one step's work items (request, token range) into a ForwardBatch, runs this rank's part of the
model on it (receiving and sending hidden states between pipeline stages), and samples next tokens
on the sampling rank, which shares them with every rank (hicache/parallel/pipeline.py).

`ModelRunner.step` is the scheduler's plain way of computing a step (`StepCompute`); speculative
decoding (hicache/spec/) is the other, built on the same runner for the target and for its draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.model.batch import ForwardBatch, SeqSlice
from hicache.model.families.llama import LlamaModel
from hicache.parallel.pipeline import StageLink
from hicache.scheduler.request import Request, TokenLogprob
from hicache.scheduler.sampler import sample_rows


@dataclass(frozen=True)
class WorkItem:
    """Compute KV (and maybe logits) for tokens [start, end) of `req`'s sequence, extended by `draft`:
    tokens proposed after its known ones (speculative decoding), which rows past the sequence read."""

    req: Request
    start: int
    end: int
    draft: tuple[int, ...] = ()
    logit_rows: int | None = None  # logits of this many last rows; None: of the last if it needs them

    @property
    def needs_logits(self) -> bool:
        # The chunk reaches the last known token: its logits give the next token.
        return self.end == self.req.prompt_len + len(self.req.output_ids) + len(self.draft)

    @property
    def num_logit_rows(self) -> int:
        return (1 if self.needs_logits else 0) if self.logit_rows is None else self.logit_rows

    def token(self, index: int) -> int:
        known = self.req.prompt_len + len(self.req.output_ids)
        return self.req.token(index) if index < known else self.draft[index - known]


@dataclass(frozen=True)
class StepOutput:
    """What one work item's step gave: the handle advances to `computed`, then truncates to `kept`
    (below it: rejected speculative rows), and `tokens` are appended in order."""

    computed: int
    kept: int
    tokens: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)


class StepCompute(Protocol):
    """How the scheduler computes a step's work: `ModelRunner` (plain), or speculative decoding."""

    speculative: bool

    def step(self, work: list[WorkItem], before_layer: Callable[[int], None] | None) -> list[StepOutput]:
        """One output per item, in order."""


class ModelRunner:
    speculative = False

    def __init__(self, model: LlamaModel, pool: DeviceKVPool) -> None:
        self.model = model
        self.pool = pool
        self.link = StageLink(model.pctx)

    def build(self, work: list[WorkItem]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSlice] = []
        out_slots: list[torch.Tensor] = []
        logit_rows: list[int] = []
        for item in work:
            r, s, e = item.req, item.start, item.end
            kv_slots = r.kv.slots(e)  # a view of its page table, on the pool's device: not rebuilt each step
            seqs.append(SeqSlice(len(ids), e - s, kv_slots))
            out_slots.append(kv_slots[s:e])
            ids.extend(item.token(i) for i in range(s, e))
            positions.extend(range(s, e))
            logit_rows.extend(range(len(ids) - item.num_logit_rows, len(ids)))
        dev = self.pool.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_slots=torch.cat(out_slots),
            seqs=seqs,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
        )

    def forward(
        self,
        work: list[WorkItem],
        before_layer: Callable[[int], None] | None = None,
        hidden_sink: Callable[[ForwardBatch, torch.Tensor], None] | None = None,
        carried_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Logits [rows needing logits, vocab] as float32 on the CPU on the last pipeline stage; None on
        the others, whose output went to the next stage. `hidden_sink` and `carried_hidden`: what an MTP
        head exchanges with its target and its own proposals (`ForwardBatch`)."""
        batch = self.build(work)
        batch.before_layer = before_layer
        batch.hidden_sink = hidden_sink
        batch.carried_hidden = carried_hidden
        model = self.model
        hidden = self.link.recv_hidden(batch.num_tokens, model.cfg.hidden_size, model.dtype, self.pool.device)
        out = model.forward(batch, self.pool, hidden)
        if not model.pctx.is_last_stage:
            self.link.send_hidden(out)
            return None
        return out.cpu()

    def step(self, work: list[WorkItem], before_layer: Callable[[int], None] | None = None) -> list[StepOutput]:
        """The plain step: one forward pass, the next token of every item reaching its sequence's end."""
        samples = iter(self.sample(self.forward(work, before_layer), work))
        return [StepOutput(i.end, i.end, [next(samples)] if i.needs_logits else []) for i in work]

    def sample(self, logits: torch.Tensor | None, work: list[WorkItem]) -> list[tuple[int, TokenLogprob | None]]:
        """The next token (and logprobs) of every item needing logits, in order, on every rank."""
        items = [item for item in work if item.needs_logits]
        if not items:
            return []
        samples = None
        if self.link.samples_here:
            assert logits is not None
            samples = sample_rows(logits, [item.req for item in items])
        return self.link.share_samples(samples, hash(tuple((i.req.rid, i.start, i.end) for i in items)))
