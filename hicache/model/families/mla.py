"""Multi-head latent attention (docs/DESIGN.md, "model family": `tiny-mla`), DeepSeek-V2 style, as a decoder
of the Llama family with another attention block and KV layout.

Per token and layer the cache holds one latent vector: the compressed KV c = norm(W_kva x)[:r] and the
rotary key part k_pe shared by every head (KVLayout.mla). Attention expands the rows it reads into
per-head keys [k_nope(c), k_pe] and values v(c) with W_kvb (`_expand`), for this rank's heads only.
Tensor parallelism splits the heads (q, W_kvb, o_proj) and the MLP; W_kva is not split, so every
attention-TP rank computes the same latent rows: the KV is replicated over TP, which is why it can be
page-sharded over the TP ranks when CP is off (`replicated_over_tp`, hicache/parallel/placement.py).

Every projection, of new rows or of the latent rows read back, goes through the batch-invariant ops,
so a token's keys and values do not depend on how many rows were expanded with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.mem.kv_layout import KVLayout
from hicache.model.config import ModelConfig
from hicache.model.families.llama import DecoderLayer, LlamaModel, Planned
from hicache.model.kernels import ops
from hicache.model.kernels.tp_groups import ColumnGroups, RowGroups, group_slices
from hicache.parallel.parallel import ParallelContext

FAMILY = "mla"  # LoadedModel.family of this decoder (hicache/model/families/registry.py)


@dataclass(frozen=True)
class MLAConfig(ModelConfig):
    """`head_dim` is the query/key head (nope + rope parts); values have head_dim too."""

    kv_lora_rank: int = 64  # r: the latent vector's size
    qk_rope_head_dim: int = 16  # the rotary part of every query/key head

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim


class MLALayer(DecoderLayer):
    def __init__(self, cfg: MLAConfig, w: dict[str, torch.Tensor], prefix: str, pctx: ParallelContext, cast, linear,
                 groups: int):  # fmt: skip
        super().__init__(cfg, w, prefix, pctx, cast, linear, groups)
        h0, h1 = pctx.shard_range(cfg.num_heads, "num_heads")
        d, nope = cfg.head_dim, cfg.qk_nope_head_dim
        a = prefix + "self_attn."
        self.num_heads = h1 - h0
        qs = group_slices(cfg.num_heads * d, groups, *self.group_range)
        kvbs = group_slices(cfg.num_heads * (nope + d), groups, *self.group_range)
        self.q_proj = ColumnGroups([w[a + "q_proj.weight"][q] for q in qs], linear)
        self.kv_a = linear(w[a + "kv_a_proj_with_mqa.weight"])  # replicated: every TP rank, every head
        self.kv_norm = cast(w[a + "kv_a_layernorm.weight"])
        self.kv_b = ColumnGroups([w[a + "kv_b_proj.weight"][kvb] for kvb in kvbs], linear)
        self.o_proj = RowGroups([w[a + "o_proj.weight"][:, q] for q in qs], linear, pctx)


class MLAModel(LlamaModel):
    """One rank's slice of an MLA decoder (implements `hicache.model.base.DecoderModel`)."""

    replicated_over_tp = True
    cfg: MLAConfig

    def _build_layer(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, cast, linear) -> MLALayer:
        assert isinstance(cfg, MLAConfig)
        return MLALayer(cfg, w, prefix, self.pctx, cast, linear, self.tp_groups)

    def _tp_split_heads(self) -> int:
        return self.cfg.num_heads

    def _rope_dim(self) -> int:
        return self.cfg.qk_rope_head_dim

    def _kv_layout(self) -> KVLayout:
        return KVLayout.mla(self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim)

    def _named_linears(self, layer) -> dict[str, Planned]:
        return {"q_proj": layer.q_proj, "kv_a_proj": layer.kv_a, "kv_b_proj": layer.kv_b, "o_proj": layer.o_proj}

    def _attention(self, local: int, layer, x: torch.Tensor, positions: torch.Tensor, meta, pool) -> torch.Tensor:
        cfg = self.cfg
        T, r, nope = x.shape[0], cfg.kv_lora_rank, cfg.qk_nope_head_dim
        q = layer.q_proj(x).view(T, layer.num_heads, cfg.head_dim)  # the groups' heads in order
        q = torch.cat([q[..., :nope], self.rope(q[..., nope:], positions)], dim=-1)
        kv_a = layer.kv_a(x)
        latent = ops.rms_norm(kv_a[:, :r], layer.kv_norm, cfg.rms_norm_eps)
        k_pe = self.rope(kv_a[:, r:].unsqueeze(1), positions).squeeze(1)
        kv = self.attention_layout.pack({"latent": latent, "rope": k_pe})

        def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            parts = self.kv_layout.unpack(rows)
            n = rows.shape[0]
            kvb = layer.kv_b(parts["latent"]).view(n, layer.num_heads, nope + cfg.head_dim)
            rope = parts["rope"].unsqueeze(1).expand(n, layer.num_heads, cfg.qk_rope_head_dim)
            return torch.cat([kvb[..., :nope], rope], dim=-1), kvb[..., nope:]

        return self.attention.forward(local, q, kv, meta, pool, expand).reshape(T, -1)
