"""What the engine needs of a model: its KV layout, its shard geometry, and a forward pass.

Everything above the model (pools, tiers, the model runner) sees only this Protocol, so another
family (an MLA model with a latent KV, a draft model) plugs in by implementing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.model.batch import ForwardBatch
from hicache.model.config import ModelConfig
from hicache.parallel.placement import KVSharding

if TYPE_CHECKING:  # kernels/invariance.py probes a DecoderModel
    from hicache.model.kernels.invariance import InvarianceReport


class DecoderModel(Protocol):
    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device
    kv_layout: KVLayout  # one token's KV row per local layer
    layer_range: tuple[int, int]  # [start, end) of this rank's layers, model-global
    kv_head_range: tuple[int, int]  # [start, end) of this rank's KV heads, model-global
    kv_sharding: KVSharding  # the ranks this rank's KV pages are sharded over (hicache/parallel/placement.py)
    replicated_over_tp: bool  # every attention-TP rank computes the same KV bytes (MLA's latent)
    tp_groups: int  # the fixed groups every TP size cuts each projection into (hicache/model/kernels/tp_groups.py)
    invariance: InvarianceReport | None  # the start-up self-check's verdict (hicache/model/build.py)
    # Its attributes holding one entry per local layer: the self-check runs a copy of the model over some
    # layers' entries (hicache/model/kernels/probe_layers.py).
    per_layer: tuple[str, ...]

    @property
    def num_local_layers(self) -> int: ...

    def linear_plans(self) -> dict[str, str]:
        """How the batch-invariant ops shape each weight's GEMM calls."""

    def forward(self, batch: ForwardBatch, pool: DeviceKVPool, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first pipeline stage) or hidden states (later stages) in; logits of
        `batch.logit_rows` (last stage) or hidden states out. Writes the batch's KV into `pool`."""
