"""Attention backends: how a layer's queries reach the KV of their sequences.

A backend writes the step's new K/V into the pool and attends each sequence's queries over its KV
slots. `prepare` runs once per forward pass and builds what every layer reuses (slot tables padded
for invariance, masks); `forward` runs per layer. `local` reads one rank's own pool; a
context-parallel backend (gathering sharded pages) or an MLA backend (a latent KV) plugs in beside
it through `ATTENTION_BACKENDS`, without edits to the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.model import ops
from hicache.model.batch import ForwardBatch

# Prefill queries are attended in pieces of this many rows (a multiple of ops.Q_ALIGN), each over
# only the keys it can see: a masked kernel does not skip key blocks above the diagonal, so this
# halves a fresh prefill's attention work without changing a bit (a query's result depends neither
# on fully masked trailing key blocks nor on the other rows of its call).
Q_PIECE = 512


def _padded(n: int) -> int:
    return -(-n // ops.KV_ALIGN) * ops.KV_ALIGN


@dataclass
class Piece:
    """Batch rows [start, stop) of one sequence, attending over its first `keys` slots."""

    start: int
    stop: int
    keys: int
    mask: torch.Tensor  # [1, 1, rows, keys] bool


@dataclass
class SeqPlan:
    slots: torch.Tensor  # [padded kv length] pool slots; padding repeats slot 0 (masked)
    pieces: list[Piece]


@dataclass
class DecodeGroup:
    """The step's one-token sequences, attended in a single kernel call: their keys gathered into
    one [B, L] slot table (L: the longest padded length; shorter rows padded with masked slot 0)."""

    rows: torch.Tensor  # [B] batch rows of the decode tokens
    slots: torch.Tensor  # [B * L] pool slots, row-major
    mask: torch.Tensor  # [B, 1, 1, L] bool: which keys each query sees
    length: int  # L


@dataclass
class LocalMetadata:
    out_slots: torch.Tensor  # [T] pool slot of each new token's KV
    decode: DecodeGroup | None
    seqs: list[SeqPlan] = field(default_factory=list)


class AttentionBackend(Protocol):
    def prepare(self, batch: ForwardBatch) -> object:
        """Per-forward data every layer reuses; called once before the first layer."""

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object, pool: DeviceKVPool
    ) -> torch.Tensor:
        """Writes k, v [T, Hkv, d] of the step's tokens into `pool` at layer `layer` (local index),
        then returns the attention output [T, H, d] of q [T, H, d]."""


class LocalAttention:
    """Attention over this rank's own pool: each sequence's KV is in its slots, in position order."""

    def __init__(self, scale: float, device: torch.device) -> None:
        self.scale = scale
        self.device = device

    def prepare(self, batch: ForwardBatch) -> LocalMetadata:
        decode = [s for s in batch.seqs if s.length == 1]
        if len(decode) < 2:  # a lone decode token is a one-row sequence like any other
            decode = []
        meta = LocalMetadata(batch.out_slots, self._decode_group(decode) if decode else None)
        for seq in batch.seqs:
            if seq.length == 1 and decode:
                continue
            first = seq.kv_len - seq.length  # position of the sequence's first new token
            pieces = []
            for a in range(0, seq.length, Q_PIECE):
                b = min(seq.length, a + Q_PIECE)
                keys = _padded(first + b)
                # Row i sits at position first + a + i and sees keys 0..first + a + i.
                mask = torch.ones(b - a, keys, dtype=torch.bool, device=self.device).tril(first + a)
                pieces.append(Piece(seq.start + a, seq.start + b, keys, mask[None, None]))
            meta.seqs.append(SeqPlan(self._pad_slots(seq.kv_slots, _padded(seq.kv_len)), pieces))
        return meta

    def _pad_slots(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        padded = torch.zeros(length, dtype=torch.int64, device=self.device)
        padded[: slots.shape[0]] = slots
        return padded

    def _decode_group(self, seqs) -> DecodeGroup:
        length = max(_padded(s.kv_len) for s in seqs)
        slots = torch.stack([self._pad_slots(s.kv_slots, length) for s in seqs])
        kv_lens = torch.tensor([s.kv_len for s in seqs], device=self.device)
        visible = torch.arange(length, device=self.device).unsqueeze(0) < kv_lens.unsqueeze(1)
        return DecodeGroup(
            rows=torch.tensor([s.start for s in seqs], dtype=torch.int64, device=self.device),
            slots=slots.view(-1),
            mask=visible[:, None, None, :],
            length=length,
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: LocalMetadata, pool: DeviceKVPool
    ) -> torch.Tensor:
        pool.write(layer, meta.out_slots, {"k": k, "v": v})
        out = torch.empty_like(q)
        group = meta.decode
        if group is not None:
            kv = pool.read(layer, group.slots)
            B = group.rows.shape[0]
            keys = kv["k"].view(B, group.length, *kv["k"].shape[1:]).transpose(1, 2)
            values = kv["v"].view(B, group.length, *kv["v"].shape[1:]).transpose(1, 2)
            out[group.rows] = ops.attention(q[group.rows].unsqueeze(2), keys, values, group.mask, self.scale)[:, :, 0]
        for plan in meta.seqs:
            kv = pool.read(layer, plan.slots)
            for p in plan.pieces:
                keys = kv["k"][: p.keys].transpose(0, 1).unsqueeze(0)
                values = kv["v"][: p.keys].transpose(0, 1).unsqueeze(0)
                rows = q[p.start : p.stop].transpose(0, 1).unsqueeze(0)
                out[p.start : p.stop] = ops.attention(rows, keys, values, p.mask, self.scale)[0].transpose(0, 1)
        return out


ATTENTION_BACKENDS = {"local": LocalAttention}
