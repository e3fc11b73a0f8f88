"""Attention backends: how a layer's queries reach the KV of their sequences.

A backend writes the step's new KV rows (packed as the pool's layout packs them) into the pool and
attends each sequence's queries over its KV. `prepare` runs once per forward pass and builds what every
layer reuses (slot tables padded for invariance, masks); `forward` runs per layer and turns the rows
it attends over into keys and values with the model's `expand` (GQA: unpack K and V; MLA: project the
latent vector), so one backend serves both KV flavours. `local` reads one rank's own pool; `gathered`
(hicache/model/attention/gathered.py) attends over pages sharded across ranks, gathered layer by layer, and
decides which of the step's rows this rank computes (`local_rows`, `collect`). The model picks one
through `ATTENTION_BACKENDS` and is the same code for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.model.batch import ForwardBatch
from hicache.model.kernels import ops
from hicache.parallel.placement import KVSharding

# Packed KV rows [L, row] -> keys [L, Hkv, d] and values [L, Hkv, dv] of this rank's heads.
Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

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
    def prepare(self, batch: ForwardBatch, pool: DeviceKVPool) -> Any:
        """Per-forward data every layer reuses; called once before the first layer."""

    def local_rows(self, meta: Any) -> torch.Tensor | None:
        """Which of the batch's rows this rank computes (None: all of them)."""

    def forward(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta: Any, pool: DeviceKVPool, expand: Expand
    ) -> torch.Tensor:
        """Writes the packed KV rows `kv` [T', row] of this rank's rows of the step into `pool` at layer
        `layer` (local index), then returns the attention output [T', H, dv] of their q [T', H, d]."""

    def collect(self, hidden: torch.Tensor, meta: Any) -> torch.Tensor:
        """This rank's rows' output -> every row of the batch (the identity when it computed them all)."""

    def close(self, meta: Any) -> None:
        """The forward pass ended, done or failed (background work of `meta` stops)."""


class LocalAttention:
    """Attention over this rank's own pool: each sequence's KV is in its slots, in position order."""

    def __init__(
        self, scale: float, device: torch.device, pctx: object = None, sharding: KVSharding | None = None
    ) -> None:
        self.scale = scale
        self.device = device

    def local_rows(self, meta: LocalMetadata) -> None:
        return None

    def collect(self, hidden: torch.Tensor, meta: LocalMetadata) -> torch.Tensor:
        return hidden

    def close(self, meta: LocalMetadata) -> None:
        pass

    def prepare(self, batch: ForwardBatch, pool: DeviceKVPool | None = None) -> LocalMetadata:
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
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta: LocalMetadata, pool: DeviceKVPool, expand: Expand
    ) -> torch.Tensor:
        pool.write_rows(layer, pool.owned(meta.out_slots), kv)
        out: torch.Tensor | None = None
        group = meta.decode
        if group is not None:
            k, v = expand(pool.read_rows(layer, group.slots))
            B = group.rows.shape[0]
            keys = k.view(B, group.length, *k.shape[1:]).transpose(1, 2)
            values = v.view(B, group.length, *v.shape[1:]).transpose(1, 2)
            got = ops.attention(q[group.rows].unsqueeze(2), keys, values, group.mask, self.scale)[:, :, 0]
            out = _into(out, q, got.shape[-1])
            out[group.rows] = got
        for plan in meta.seqs:
            k, v = expand(pool.read_rows(layer, plan.slots))
            for p in plan.pieces:
                got = attend_piece(q[p.start : p.stop], k, v, p, self.scale)
                out = _into(out, q, got.shape[-1])
                out[p.start : p.stop] = got
        return _into(out, q, q.shape[-1])


def _into(out: torch.Tensor | None, q: torch.Tensor, dv: int) -> torch.Tensor:
    """The output buffer [T, H, dv] (values may be narrower than queries: MLA's rope part)."""
    return out if out is not None else q.new_zeros(*q.shape[:2], dv)


def attend_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: Piece, scale: float) -> torch.Tensor:
    """Queries q [n, H, d] of one piece over the first piece.keys of one sequence's keys and values
    [L, Hkv, d|dv] (position order, padded): [n, H, dv]."""
    keys = k[: piece.keys].transpose(0, 1).unsqueeze(0)
    values = v[: piece.keys].transpose(0, 1).unsqueeze(0)
    rows = q.transpose(0, 1).unsqueeze(0)
    return ops.attention(rows, keys, values, piece.mask, scale)[0].transpose(0, 1)


def _gathered(*args: Any, **kwargs: Any) -> Any:
    from hicache.model.attention.gathered import GatheredAttention  # it builds on the helpers above

    return GatheredAttention(*args, **kwargs)


ATTENTION_BACKENDS: dict[str, Callable[..., Any]] = {"local": LocalAttention, "gathered": _gathered}
