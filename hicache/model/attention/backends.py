"""Attention backends: how a layer's queries reach the KV of their sequences.

A backend writes the step's new KV rows (packed as the pool's layout packs them) into the pool and
attends each sequence's queries over its KV. `prepare` runs once per forward pass and builds what every
layer reuses (the key-block plan of hicache/model/kernels/key_blocks.py and what each of its reads
reads); `forward` runs per layer and turns the rows it attends over into keys and values with the
model's `expand` (GQA: unpack K and V; MLA: project the latent vector), so one backend serves both KV
flavours. `local` reads one rank's own pool; `gathered`
(hicache/model/attention/gathered.py) attends over pages sharded across ranks, gathered layer by layer, and
decides which of the step's rows this rank computes (`local_rows`, `collect`). The model picks one
through `ATTENTION_BACKENDS` and is the same code for both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.model.batch import ForwardBatch
from hicache.model.kernels import key_blocks, native_attention, ops
from hicache.parallel.placement import KVSharding

# Packed KV rows [L, row] -> keys [L, Hkv, d] and values [L, Hkv, dv] of this rank's heads.
Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class UnpackKV:
    """The Expand of a layout holding keys and values as they are (GQA): views of the packed rows, so
    attention may read them in the pool itself, by slot, instead of a gathered copy."""

    layout: KVLayout

    def __call__(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.layout.unpack(rows)
        return parts["k"], parts["v"]


def step_queries(batch: ForwardBatch, n: int = 1, r: int = 0) -> list[key_blocks.QueryRows]:
    """The query rows of each sequence of the step that a rank computing batch rows r, r + n, r + 2n, ...
    holds (its row k is batch row r + n * k), and the keys each sees: its position + 1."""
    out = []
    for i, seq in enumerate(batch.seqs):
        lo, hi = -(-(seq.start - r) // n), -(-(seq.start + seq.length - r) // n)
        if hi > lo:
            seen = seq.kv_len - seq.length + 1 + r + n * lo - seq.start  # the first row's position + 1
            out.append(key_blocks.QueryRows(i, lo, tuple(range(seen, seen + n * (hi - lo), n))))
    return out


@dataclass
class LocalMetadata:
    out_slots: torch.Tensor  # [T] pool slot of each new token's KV
    plan: key_blocks.KeyBlockPlan
    # Per read of the plan, the pool slots it reads: views of the sequences' slots, and slot 0 (masked)
    # past an end. Joined when first read and kept for the forward pass's other layers (`joined`): a
    # layer then reads the very tensors the first one did (what key_block_attention.py's replay checks);
    # they hold 8 bytes a key of the step, as the sequences' own slots do.
    slots: list[list[torch.Tensor]]
    joined: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    # The plan's layers after the first in one native call each, once the first ran every call in place.
    replay: native_attention.Replay | None = None

    def read_slots(self, i: int) -> torch.Tensor:
        joined = self.joined.get(i)
        if joined is None:
            parts = self.slots[i]
            joined = self.joined[i] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return joined


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

    def replayed_layers(self, meta: Any, pool: DeviceKVPool, expand: Expand, width: int, layers: int) -> tuple | None:
        """What fused_layer.LayerStack needs to run the attention of `layers` layers (local indexes 0 ..) as
        the replay of the plan an earlier layer ran: per layer, where its KV rows `width` wide are written
        and its k/v views, then the recorded calls and the scale; None where the backend does not replay."""

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

    def replayed_layers(self, meta: LocalMetadata, pool: DeviceKVPool, expand: Expand, width: int,
                        layers: int) -> tuple | None:  # fmt: skip
        if meta.replay is None:  # set by the first layer that ran the plan natively in place (`forward`)
            return None
        where = pool.owned(meta.out_slots)
        targets = [pool.write_target(layer, where, width) for layer in range(layers)]
        views = [expand(pool.buffers[layer]) for layer in range(layers)]
        return ([dst for dst, _ in targets], [k for k, _ in views], [v for _, v in views], [at for _, at in targets],
                *meta.replay.operands, self.scale)  # fmt: skip

    def prepare(self, batch: ForwardBatch, pool: DeviceKVPool | None = None) -> LocalMetadata:
        plan = key_blocks.plan(step_queries(batch), batch.num_tokens, self.device)
        longest = max((read.length for read in plan.reads), default=0)
        padding = torch.zeros(longest, dtype=torch.int64, device=self.device)
        # Each sequence's slots cut at the plan's block starts in one call: a read takes its block's view,
        # where slicing each read's view apart cost a few microseconds a (sequence, block) every step.
        block = key_blocks.KV_BLOCK
        blocks = [seq.kv_slots.split(block) for seq in batch.seqs]
        ends = [seq.kv_len for seq in batch.seqs]
        slots = []
        for read in plan.reads:
            parts = []
            for seq, first in read.entries:
                got, have = blocks[seq][first // block], min(block, ends[seq] - first)
                if have > read.length:
                    got = got[: read.length]
                parts += [got, padding[: read.length - have]] if have < read.length else [got]
            slots.append(parts)
        return LocalMetadata(batch.out_slots, plan, slots)

    def forward(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta: LocalMetadata, pool: DeviceKVPool, expand: Expand
    ) -> torch.Tensor:
        where = pool.owned(meta.out_slots)
        if meta.replay is not None:  # an earlier layer ran the plan in place: this one's bits in one call
            k, v = expand(pool.buffers[layer])
            return meta.replay(q, kv, *pool.write_target(layer, where, kv.shape[1]), k, v, self.scale)
        pool.write_rows(layer, where, kv)
        if isinstance(expand, UnpackKV) and not pool.sharded:
            k, v = expand(pool.buffers[layer])
            if native_attention.takes(q, k, v):  # it reads the pool by slot: each KV byte once a step

                def in_place(i: int) -> tuple[torch.Tensor, ...]:
                    return k, v, meta.read_slots(i)

                out = ops.block_attention(q, meta.plan, in_place, self.scale)
                if meta.plan.native_calls is not None:  # recorded: every call was native and in place
                    meta.replay = native_attention.Replay(meta.plan)
                return out

        def read(i: int) -> tuple[torch.Tensor, ...]:
            return expand(pool.read_rows(layer, meta.read_slots(i)))

        return ops.block_attention(q, meta.plan, read, self.scale)


def _gathered(*args: Any, **kwargs: Any) -> Any:
    from hicache.model.attention.gathered import GatheredAttention  # it builds on the helpers above

    return GatheredAttention(*args, **kwargs)


ATTENTION_BACKENDS: dict[str, Callable[..., Any]] = {"local": LocalAttention, "gathered": _gathered}
