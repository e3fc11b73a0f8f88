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
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: pool slot where each new token's KV is written
    seqs: list[SeqSlice]
    logit_rows: torch.Tensor  # rows whose next-token logits are needed
    # Called with a layer index before the layer reads the pool, so a layer-wise load of cached KV
    # (host -> device) only has to be complete for the layer about to run.
    before_layer: Callable[[int], None] | None = field(default=None)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
