"""A Llama decoder with per-token state beside its KV (docs/DESIGN.md, "model family": drafts), the shape of
`tiny-draft-sidecar`.

Each layer keeps a small token-shift vector s_t = W_in · norm(h_t) in its pool row, as a KV component
of its own (`shift`), and adds W_out · s_{t-1} to the residual before attention. A token's output thus
depends on the stored state of the token before it, read back from the pool: the stand-in for an
indexer buffer or a convolution / recurrent state, which a cache has to restore with the KV, or the
model's output changes. Both projections go through the batch-invariant ops and the state is read
from the pool for every row (also for the rows of the same step, written first), so a token's result
is the same whatever chunk or batch it is computed in.
"""

from __future__ import annotations

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVComponent, KVLayout
from hicache.model.batch import ForwardBatch
from hicache.model.families.llama import LlamaLayer, LlamaModel, MakeLinear
from hicache.model.kernels import ops

SHIFT = "shift"
FAMILY = "token_shift"  # LoadedModel.family of a model with these weights (hicache/model/families/registry.py)


def shift_weight_names(layer: int) -> tuple[str, str]:
    p = f"model.layers.{layer}.shift."
    return p + "in_proj.weight", p + "out_proj.weight"


class TokenShiftModel(LlamaModel):
    """`LlamaModel` plus the per-layer token-shift state (weights `model.layers.{i}.shift.in_proj` [S,
    hidden] and `.out_proj` [hidden, S])."""

    page_shardable = False  # a row reads its predecessor's state, which CP may hold on another rank
    per_layer = (*LlamaModel.per_layer, "shift_in", "shift_out")

    def _build_own(self, weights: dict[str, torch.Tensor], make_linear: MakeLinear) -> None:
        names = [shift_weight_names(i) for i in range(*self.layer_range)]
        self.shift_in = [make_linear(weights[a]) for a, _ in names]
        self.shift_out = [make_linear(weights[b]) for _, b in names]
        dim = self.shift_in[0].out_features
        self.kv_layout = KVLayout(self.kv_layout.components + (KVComponent(SHIFT, (dim,)),))
        # Where each row of the forward pass in progress writes its state, and reads its predecessor's.
        self._slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def linear_plans(self) -> dict[str, str]:
        return {**super().linear_plans(), "shift_in": self.shift_in[0].plan.describe(),
                "shift_out": self.shift_out[0].plan.describe()}  # fmt: skip

    def forward(self, batch: ForwardBatch, pool: DeviceKVPool, hidden: torch.Tensor | None = None) -> torch.Tensor:
        self._slots = (batch.out_slots, *batch.predecessors(self.dtype))
        try:
            return super().forward(batch, pool, hidden)
        finally:
            self._slots = None

    def _layer(
        self, local: int, layer: LlamaLayer, hidden: torch.Tensor, positions: torch.Tensor, meta, pool: DeviceKVPool
    ) -> torch.Tensor:
        assert self._slots is not None, "a layer runs only inside forward"
        out_slots, prev_slots, keep = self._slots
        x = ops.rms_norm(hidden, layer.input_norm, self.cfg.rms_norm_eps)
        pool.write(local, out_slots, {SHIFT: self.shift_in[local](x)})
        previous = pool.read(local, prev_slots)[SHIFT] * keep
        hidden = hidden + self.shift_out[local](previous)
        return super()._layer(local, layer, hidden, positions, meta, pool)
