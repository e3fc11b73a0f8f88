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
    # Called on the last pipeline stage with the batch and its final hidden states [T, hidden] (before
    # the final norm): an MTP head reads the target's (hicache/model/families/mtp.py).
    hidden_sink: Callable[[ForwardBatch, torch.Tensor], None] | None = field(default=None)
    # Per row, the hidden state an MTP head reads as its predecessor's instead of the pool's: its
    # proposals chain on its own output, which no target computed.
    carried_hidden: torch.Tensor | None = field(default=None)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def predecessors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the slot of the token before it, and 1 (or 0 at position 0, which has none): where a
        model with per-token state reads its predecessor's (hicache/model/families/shift.py and mtp.py)."""
        device = self.input_ids.device
        prev = torch.zeros(self.num_tokens, dtype=torch.int64, device=device)
        keep = torch.ones(self.num_tokens, 1, dtype=dtype, device=device)
        for seq in self.seqs:
            first = seq.kv_len - seq.length  # position of the sequence's first new token
            if first == 0:
                keep[seq.start] = 0
                prev[seq.start + 1 : seq.start + seq.length] = seq.kv_slots[: seq.length - 1]
            else:
                prev[seq.start : seq.start + seq.length] = seq.kv_slots[first - 1 : seq.kv_len - 1]
        return prev, keep
