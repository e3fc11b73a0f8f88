"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) holding one rank's share of the model.

Pipeline parallelism gives a rank a contiguous layer range; tensor parallelism gives it a contiguous
range of KV heads (with the query heads that share them) and of MLP columns, with a sum over the TP
ranks after the attention output and MLP down projections. Every projection is cut into the same fixed
groups at every TP size, and the sums added in one fixed order, so any TP size computes the bits TP1
computes (hicache/model/kernels/tp_groups.py). At tp_size = pp_size = 1 it is the whole model.

The forward pass is varlen: requests' new tokens are concatenated, linear layers run once over all of
them, and the attention backend attends each request over the KV slots it owns in the pool. Every
GEMM, attention kernel and cross-rank sum goes through the batch-invariant ops
(hicache/model/kernels/ops.py). With KV pages sharded over ranks (context parallelism) the backend is
the gathered one (hicache/model/attention/gathered.py): it says which of the step's rows this rank
computes and collects every rank's rows after the last layer; the model itself is the same code.
"""

from __future__ import annotations

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.model.attention.backends import ATTENTION_BACKENDS, AttentionBackend, UnpackKV
from hicache.model.batch import ForwardBatch
from hicache.model.config import ModelConfig
from hicache.model.families.checkpoint import CheckpointFamily
from hicache.model.kernels import activations, ops
from hicache.model.kernels.fused_layer import LayerHead, LayerTail, layer_head, layer_stack, layer_tail
from hicache.model.kernels.invariance import InvarianceReport
from hicache.model.kernels.tp_groups import ColumnGroups, MakeLinear, RowGroups, group_slices, tp_group_count
from hicache.model.rope import RotaryEmbedding
from hicache.parallel.parallel import ParallelContext
from hicache.parallel.placement import KVSharding

Planned = ops.Linear | ColumnGroups | RowGroups  # what names a linear plan for logs and /health


class DecoderLayer:
    """What every layer of the family has: the norms and this rank's groups of the gated MLP's
    columns, the same groups at every TP size (hicache/model/kernels/tp_groups.py). `cfg.parts` says
    which norms and which activation (hicache/model/config.py, LayerParts)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, pctx: ParallelContext, cast, linear,
                 groups: int):  # fmt: skip
        pctx.shard_range(cfg.intermediate_size, "intermediate_size")  # refuses a TP size that cannot split it
        self.group_range = pctx.shard_range(groups, "TP groups")
        columns = group_slices(cfg.intermediate_size, groups, *self.group_range)
        m = prefix + "mlp."
        self.parts = cfg.parts
        sandwich = cfg.parts.sandwich_norms
        self.input_norm = cast(w[prefix + "input_layernorm.weight"])
        # The MLP's input norm: Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm (its
        # post_attention_layernorm norms attention's output, before the residual add, as `mlp_out_norm` the MLP's).
        self.post_norm = cast(w[prefix + ("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")
                                + ".weight"])  # fmt: skip
        self.attn_out_norm = cast(w[prefix + "post_attention_layernorm.weight"]) if sandwich else None
        self.mlp_out_norm = cast(w[prefix + "post_feedforward_layernorm.weight"]) if sandwich else None
        # gate and up share the input: one matmul per group instead of two.
        self.gate_up = ColumnGroups([torch.cat([w[m + "gate_proj.weight"][c], w[m + "up_proj.weight"][c]])
                                     for c in columns], linear)  # fmt: skip
        self.down_proj = RowGroups([w[m + "down_proj.weight"][:, c] for c in columns], linear, pctx)
        # What comes before and after attention in one native call each (set by the model; kernels/fused_layer.py).
        self.head: LayerHead | None = None
        self.tail: LayerTail | None = None
        self.rope: RotaryEmbedding | None = None  # this layer's RoPE (set by the model: sliding layers may differ)


class LlamaLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, pctx: ParallelContext, cast, linear,
                 groups: int):  # fmt: skip
        super().__init__(cfg, w, prefix, pctx, cast, linear, groups)
        kv0, kv1 = pctx.shard_range(cfg.num_kv_heads, "num_kv_heads")
        group = cfg.num_heads // cfg.num_kv_heads
        d = cfg.head_dim
        a = prefix + "self_attn."
        self.num_heads = (kv1 - kv0) * group
        self.num_kv_heads = kv1 - kv0
        self.head_dim = d
        self.kv_per_group = cfg.num_kv_heads // groups
        self.q_per_group = self.kv_per_group * group
        g0, g1 = self.group_range
        qs = group_slices(cfg.num_heads * d, groups, g0, g1)
        kvs = group_slices(cfg.num_kv_heads * d, groups, g0, g1)
        # q, k and v share the input: one matmul per group; its output's columns are q | k | v.
        self.qkv_proj = ColumnGroups([torch.cat([w[a + "q_proj.weight"][q], w[a + "k_proj.weight"][kv],
                                                 w[a + "v_proj.weight"][kv]])
                                      for q, kv in zip(qs, kvs)], linear)  # fmt: skip
        self.o_proj = RowGroups([w[a + "o_proj.weight"][:, q] for q in qs], linear, pctx)
        # Qwen2's biases, laid out as qkv_proj's output [groups, q | k | v].
        self.qkv_bias = cast(torch.stack([torch.cat([w[a + "q_proj.bias"][q], w[a + "k_proj.bias"][kv],
                                                     w[a + "v_proj.bias"][kv]]) for q, kv in zip(qs, kvs)])
                             ) if cfg.parts.qkv_bias else None  # fmt: skip
        # Qwen3's and Gemma 3's RMSNorm of each query and key head before RoPE.
        self.q_norm = cast(w[a + "q_norm.weight"]) if cfg.parts.qk_norm else None
        self.k_norm = cast(w[a + "k_norm.weight"]) if cfg.parts.qk_norm else None


FAMILY = "llama"  # LoadedModel.family of this decoder (hicache/model/families/registry.py)
LLAMA = CheckpointFamily("Llama", gguf_arch="llama")  # Llama 2/3 and Mistral: the decoder's own names and parts


class LlamaModel:
    """One rank's slice of the decoder (implements `hicache.model.base.DecoderModel`). `forward` takes
    token ids on the first stage and hidden states on later ones; it returns logits for
    `batch.logit_rows` on the last stage, hidden states otherwise."""

    # Whether every attention-TP rank would hold the same KV bytes (MLA's latent), so the pages can be
    # sharded over TP (hicache/parallel/placement.py).
    replicated_over_tp = False
    # Whether its pages can be sharded over CP ranks: nothing but attention (which gathers them) reads
    # another token's row.
    page_shardable = True
    # Whether it reads the target's final hidden states (an MTP head, hicache/model/families/mtp.py).
    reads_target_hidden = False
    # What holds one entry per local layer (the self-check probes a subset: kernels/probe_layers.py).
    per_layer: tuple[str, ...] = ("layers",)

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        pctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        make_linear: MakeLinear,
        sharding: KVSharding | None = None,
    ) -> None:
        self.cfg = cfg
        self.pctx = pctx
        self.dtype = dtype
        self.device = device
        self.kv_sharding = sharding or KVSharding()
        self.layer_range = pctx.layer_range(cfg.num_layers)
        self.kv_head_range = pctx.shard_range(cfg.num_kv_heads, "num_kv_heads")

        def cast(t: torch.Tensor) -> torch.Tensor:  # what stays dense: norms, the embedding table
            return t.to(device=device, dtype=dtype).contiguous()

        self.tp_groups = tp_group_count(self._tp_split_heads(), cfg.intermediate_size)
        self.rope = RotaryEmbedding(self._rope_dim(), cfg.rope_theta, cfg.rope_scaling, device)
        self.layers = [self._build_layer(cfg, weights, f"model.layers.{i}.", cast, make_linear)
                       for i in range(*self.layer_range)]  # fmt: skip
        fusable_head = type(self)._attention is LlamaModel._attention  # what layer_head computes
        for index, layer in zip(range(*self.layer_range), self.layers):
            layer.rope = self._layer_rope(index)
            fused = fusable_head and layer.rope is self.rope  # the native head rotates by the model's tables
            layer.head = layer_head(layer, cfg.rms_norm_eps, dtype) if fused else None
            layer.tail = layer_tail(layer, cfg.rms_norm_eps, pctx, dtype)
        # The layers after the first in one native call, where each is head, attention and tail (`_layer`).
        self.layer_stack = layer_stack(self.layers) if type(self)._layer is LlamaModel._layer else None
        self.embed = cast(weights["model.embed_tokens.weight"]) if pctx.is_first_stage else None
        if pctx.is_last_stage:
            self.norm = cast(weights["model.norm.weight"])
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            self.lm_head = make_linear(weights[head])
        backend = "gathered" if self.kv_sharding.size > 1 else "local"
        make = ATTENTION_BACKENDS[backend]
        self.attention: AttentionBackend = make(cfg.attention_scale, device, pctx, self.kv_sharding)
        # What attention packs and writes; the pool's row may carry state after it (shift.py).
        self.attention_layout = self._kv_layout()
        self.kv_layout = self.attention_layout
        self.invariance: InvarianceReport | None = None  # what the start-up self-check found (hicache/model/build.py)
        self._build_own(weights, make_linear)

    # ---- what a model of the family chooses ----------------------------------------------------

    def _build_own(self, weights: dict[str, torch.Tensor], make_linear: MakeLinear) -> None:
        """What a family holds beyond Llama's parts (its weights, its rows in the pool), built last."""

    def _build_layer(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, cast, linear) -> DecoderLayer:
        return LlamaLayer(cfg, w, prefix, self.pctx, cast, linear, self.tp_groups)

    def _layer_rope(self, index: int) -> RotaryEmbedding:
        """The RoPE layer `index` (model-global) rotates by: the model's, unless some layers have their own
        (hybrid.py)."""
        return self.rope

    def _tp_split_heads(self) -> int:
        """The heads TP splits: each rank holds whole KV heads with the query heads that share them."""
        return self.cfg.num_kv_heads

    def _rope_dim(self) -> int:
        return self.cfg.head_dim

    def _kv_layout(self) -> KVLayout:
        return KVLayout.mha(self.kv_head_range[1] - self.kv_head_range[0], self.cfg.head_dim)

    def _named_linears(self, layer) -> dict[str, Planned]:
        return {"qkv_proj": layer.qkv_proj, "o_proj": layer.o_proj}

    def _attention(self, local: int, layer, x: torch.Tensor, positions: torch.Tensor, meta, pool) -> torch.Tensor:
        """This rank's heads' attention output [T, heads * dv] for normed inputs x [T, hidden]."""
        q, k, v = self._qkv(layer, x, positions)
        return self._attend(local, q, self.attention_layout.pack({"k": k, "v": v}), meta, pool)

    def _attend(self, local: int, q: torch.Tensor, kv: torch.Tensor, meta, pool) -> torch.Tensor:
        """Attention output [T, heads * dv] of queries q [T, heads, d], the step's packed KV rows written first."""
        return self.attention.forward(local, q, kv, meta, pool, UnpackKV(self.kv_layout)).reshape(q.shape[0], -1)

    def _qkv(self, layer, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [T, heads, d] and keys [T, kv heads, d], and values, of normed inputs x."""
        T, d, h = x.shape[0], layer.head_dim, layer.num_heads
        nq, nkv = layer.q_per_group, layer.kv_per_group
        qkv = layer.qkv_proj(x)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qkv = qkv.view(T, -1, nq + 2 * nkv, d)  # [T, groups, q | k | v heads, d]
        qk = qkv[:, :, : nq + nkv]
        if layer.q_norm is not None:
            eps = self.cfg.rms_norm_eps
            qk = torch.cat([ops.rms_norm(qk[:, :, :nq], layer.q_norm, eps),
                            ops.rms_norm(qk[:, :, nq:], layer.k_norm, eps)], dim=2)  # fmt: skip
        # RoPE is elementwise per head: one call rotates q's and k's heads alike.
        qk = layer.rope(qk.reshape(T, -1, d), positions).view(T, -1, nq + nkv, d)
        q = qk[:, :, :nq].reshape(T, h, d)
        k = qk[:, :, nq:].reshape(T, layer.num_kv_heads, d)
        v = qkv[:, :, nq + nkv :].reshape(T, layer.num_kv_heads, d)
        return q, k, v

    def _expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return UnpackKV(self.kv_layout)(rows)

    @property
    def num_local_layers(self) -> int:
        return len(self.layers)

    def linear_plans(self) -> dict[str, str]:
        """How each distinct weight shape's GEMMs are shaped, for logs and /health."""
        layer = self.layers[0]
        named = {**self._named_linears(layer), "gate_up_proj": layer.gate_up, "down_proj": layer.down_proj}
        if self.pctx.is_last_stage:
            named["lm_head"] = self.lm_head
        return {name: lin.plan.describe() for name, lin in named.items()}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: DeviceKVPool, hidden: torch.Tensor | None = None) -> torch.Tensor:
        meta = self.attention.prepare(batch, pool)
        try:
            rows = self.attention.local_rows(meta)  # this rank's rows of the step (None: all)
            positions = batch.positions if rows is None else batch.positions[rows]
            if hidden is None:
                assert self.embed is not None, "only the first pipeline stage embeds tokens"
                hidden = self.embed[batch.input_ids if rows is None else batch.input_ids[rows]]
                if self.cfg.parts.embedding_scale != 1.0:  # Gemma: rounded to the activation dtype first, as it does
                    hidden = hidden * torch.tensor(self.cfg.parts.embedding_scale, dtype=hidden.dtype)
            elif rows is not None:
                hidden = hidden[rows]
            for local, layer in enumerate(self.layers):
                if batch.before_layer is not None:
                    batch.before_layer(local)
                elif local and self.layer_stack is not None:
                    replayed = self.attention.replayed_layers(
                        meta, pool, UnpackKV(self.kv_layout), self.attention_layout.row_numel, len(self.layers)
                    )
                    if replayed is not None:  # layer 0 ran the plan in place: the rest in one native call
                        hidden = self.layer_stack(hidden, *self.rope.tables(positions, hidden.dtype), local, replayed)
                        break
                hidden = self._layer(local, layer, hidden, positions, meta, pool)
            hidden = self.attention.collect(hidden, meta)
        finally:
            self.attention.close(meta)
        if not self.pctx.is_last_stage:
            return hidden
        if batch.hidden_sink is not None:
            batch.hidden_sink(batch, hidden)
        rows = ops.rms_norm(hidden[batch.logit_rows], self.norm, self.cfg.rms_norm_eps)
        return activations.softcap(self.lm_head(rows).float(), self.cfg.parts.final_logit_softcap)

    def _layer(
        self, local: int, layer: DecoderLayer, hidden: torch.Tensor, positions: torch.Tensor, meta, pool: DeviceKVPool
    ) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        if layer.head is not None:  # _attention's projections in one call, the same bits (kernels/fused_layer.py)
            attn = self._attend(local, *layer.head(hidden, *self.rope.tables(positions, hidden.dtype)), meta, pool)
        else:
            attn = self._attention(local, layer, ops.rms_norm(hidden, layer.input_norm, eps), positions, meta, pool)
        if layer.tail is not None:  # the lines below in one call, the same bits (kernels/fused_layer.py)
            return layer.tail(hidden, attn)
        hidden = hidden + self._normed(layer.o_proj(attn), layer.attn_out_norm)
        x = ops.rms_norm(hidden, layer.post_norm, eps)
        gate_up = layer.gate_up(x)  # [T, groups, gate | up]
        mlp = layer.down_proj(activations.gated_activation(gate_up, layer.parts.activation))
        return hidden + self._normed(mlp, layer.mlp_out_norm)

    def _normed(self, x: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        return x if norm is None else ops.rms_norm(x, norm, self.cfg.rms_norm_eps)
