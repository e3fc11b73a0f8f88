"""One forward step's worth of tokens from several requests, flattened (varlen), and where their KV goes.

Requests contribute a contiguous run of new tokens each (a prefill chunk or one decode token). Attention
for a request reads the KV of all its slots: the cached prefix, earlier chunks, and the new tokens,
which the layer writes into the pool before reading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class SeqSlice:
    """Rows [start, start + length) of the batch belong to one request whose KV lives at `kv_slots`
    (kv_len slots: prefix + these new tokens, in position order)."""

    start: int
    length: int
    kv_slots: torch.Tensor

    @property
    def kv_len(self) -> int:
        return int(self.kv_slots.shape[0])


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
