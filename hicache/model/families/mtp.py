"""An MTP / EAGLE-shaped draft head (docs/DESIGN.md, "Speculative decoding: an MTP head"), the shape of
`tiny-mtp`: DeepSeek-V3's multi-token-prediction module.

Its row for token x_p reads the target's final hidden state h_{p-1} (before the final norm) and the
embedding of x_p, normed apart and concatenated, projects them (2H -> H, `mtp.eh_proj`), runs one
decoder layer with KV of its own, and the target's final norm and output head (shared) give its
proposal for x_{p+1}. Where no target computed h_{p-1} (the proposals after the first), the head reads
its own output at p-1 instead (`ForwardBatch.carried_hidden`).

The target's hidden state of each token lives in the head's pool row, beside its KV (component
`hidden`): the target writes it for every row it computes (`store_target_hidden`, through
`ForwardBatch.hidden_sink`; under PP the last stage's, sent to every stage's copy of the head by
hicache/spec/decoder.py), and the head reads its predecessor's. So it is backed up, stored and
restored with the head's KV, like `shift.py`'s state. A row reads another token's row, which under CP
may be on a page of another rank: the head reads its predecessors from their owners
(`kv_gather.rows_from_owners`), so its pages shard like the target's.
"""

from __future__ import annotations

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVComponent, KVLayout
from hicache.model.attention.kv_gather import rows_from_owners
from hicache.model.batch import ForwardBatch
from hicache.model.families.llama import LlamaModel, MakeLinear
from hicache.model.kernels import ops

HIDDEN = "hidden"
FAMILY = "mtp"  # LoadedModel.family of a model with these weights (hicache/model/families/registry.py)
ENORM, HNORM, EH_PROJ = "mtp.enorm.weight", "mtp.hnorm.weight", "mtp.eh_proj.weight"


class MTPHeadModel(LlamaModel):
    """`LlamaModel` of one layer behind the MTP input projection (weights `mtp.enorm` [H], `mtp.hnorm` [H]
    and `mtp.eh_proj` [H, 2H], the embedding first), with the target's hidden state in its pool row."""

    page_shardable = True  # a row's predecessor may be on another CP rank's page: read from its owner
    reads_target_hidden = True

    def _build_own(self, weights: dict[str, torch.Tensor], make_linear: MakeLinear) -> None:
        cfg, device, dtype = self.cfg, self.device, self.dtype
        self.enorm, self.hnorm = (weights[n].to(device=device, dtype=dtype).contiguous() for n in (ENORM, HNORM))
        self.eh_proj = make_linear(weights[EH_PROJ])
        self.kv_layout = KVLayout(self.kv_layout.components + (KVComponent(HIDDEN, (cfg.hidden_size,)),))

    def linear_plans(self) -> dict[str, str]:
        return {**super().linear_plans(), "eh_proj": self.eh_proj.plan.describe()}

    def store_target_hidden(self, pool: DeviceKVPool, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """The target's final hidden states of the tokens at `slots`, for the head's rows after them."""
        pool.write(0, slots.to(self.device), {HIDDEN: hidden.to(device=self.device, dtype=self.dtype)})

    def forward(self, batch: ForwardBatch, pool: DeviceKVPool, hidden: torch.Tensor | None = None) -> torch.Tensor:
        assert hidden is None and self.embed is not None, "an MTP head runs whole, on one stage"
        previous = batch.carried_hidden
        if previous is None:
            if batch.before_layer is not None:
                batch.before_layer(0)  # its rows may still be loading from host memory
            previous = self._predecessors(batch, pool)
        eps = self.cfg.rms_norm_eps
        x = torch.cat([ops.rms_norm(self.embed[batch.input_ids], self.enorm, eps),
                       ops.rms_norm(previous.to(self.dtype), self.hnorm, eps)], dim=-1)  # fmt: skip
        return super().forward(batch, pool, self.eh_proj(x))

    def _predecessors(self, batch: ForwardBatch, pool: DeviceKVPool) -> torch.Tensor:
        """Per row, the target's hidden state of the token before it, read from the pool: under CP from
        whichever rank owns its page (every rank computes every row's input projection)."""
        prev, keep = batch.predecessors(self.dtype)
        group = self.pctx.group(self.kv_sharding.axis) if self.kv_sharding.axis else None
        return pool.layout.unpack(rows_from_owners(pool, 0, prev, group))[HIDDEN] * keep
