"""One forward step's worth of tokens from several requests, flattened (varlen), and where their KV goes.

Requests contribute a contiguous run of new tokens each (a prefill chunk or one decode token). Attention
for a request reads the KV of all its slots: the cached prefix, earlier chunks, and the new tokens,
which the layer writes into the pool before reading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


# Batch invariance: a cache hit must reproduce the cache-off logits bit for bit, so a query's attention
# result may not depend on how many other queries and keys share its kernel call (a decode step vs. a
# row of a prefill chunk). CPU flash attention splits keys into blocks of up to 512 and queries into
# blocks of 32/64/256; a short last key block, or a query block of one to three rows, is summed in a
# different order. Padding keys (masked) to a multiple of KV_ALIGN and queries (discarded rows) to a
# multiple of Q_ALIGN removes both. Measured on bf16 with AVX512-BF16: see
# tests/model/test_batch_invariance.py, which fails on a platform where this no longer holds.
KV_ALIGN = 512
Q_ALIGN = 8


@dataclass
class SeqSlice:
    """Rows [start, start + length) of the batch belong to one request whose KV lives at
    `kv_slots[:kv_len]` (all of it: prefix + these new tokens, in position order); the rest of
    `kv_slots` is padding up to a multiple of KV_ALIGN, masked out of attention."""

    start: int
    length: int
    kv_slots: torch.Tensor
    kv_len: int


@dataclass
class DecodeGroup:
    """The batch's one-token sequences, attended in a single kernel call: their keys gathered into one
    [B, L] slot table (L: the longest padded length; shorter rows padded with masked slot 0)."""

    rows: torch.Tensor  # [B] batch rows of the decode tokens
    slots: torch.Tensor  # [B * L] pool slots, row-major
    mask: torch.Tensor  # [B, 1, Q_ALIGN, L] bool: which keys each (padded) query sees
    length: int  # L

    @classmethod
    def build(cls, seqs: list[SeqSlice], device: torch.device) -> "DecodeGroup":
        length = max(s.kv_slots.shape[0] for s in seqs)
        slots = torch.zeros(len(seqs), length, dtype=torch.int64, device=device)
        for i, s in enumerate(seqs):
            slots[i, : s.kv_slots.shape[0]] = s.kv_slots
        kv_lens = torch.tensor([s.kv_len for s in seqs], device=device)
        visible = torch.arange(length, device=device).unsqueeze(0) < kv_lens.unsqueeze(1)
        return cls(
            rows=torch.tensor([s.start for s in seqs], dtype=torch.int64, device=device),
            slots=slots.view(-1),
            mask=visible[:, None, None, :].expand(-1, 1, Q_ALIGN, -1).contiguous(),
            length=length,
        )


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: pool slot where each new token's KV is written
    seqs: list[SeqSlice]
    logit_rows: torch.Tensor  # rows whose next-token logits are needed
    # Called with a layer index before the layer reads the pool, so a layer-wise load of cached KV
    # (host -> device) only has to be complete for the layer about to run.
    before_layer: Callable[[int], None] | None = field(default=None)

    def split(self, device: torch.device) -> tuple[DecodeGroup | None, list[SeqSlice]]:
        """Decode tokens (batched into one attention call) and the multi-token sequences (one call each)."""
        decode = [s for s in self.seqs if s.length == 1]
        others = [s for s in self.seqs if s.length != 1]
        if len(decode) < 2:
            return None, self.seqs
        return DecodeGroup.build(decode, device), others

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
