"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) holding one rank's share of the model.

Pipeline parallelism gives a rank a contiguous layer range; tensor parallelism gives it a contiguous
range of KV heads (with the query heads that share them) and of MLP columns, with an all-reduce after
the attention output and MLP down projections. At tp_size = pp_size = 1 it is the whole model.

The forward pass is varlen: requests' new tokens are concatenated, linear layers run once over all of
them, and attention runs per request over the KV slots that request owns in the pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hicache.dist.parallel import ParallelContext
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.model.batch import KV_ALIGN, Q_ALIGN, DecodeGroup, ForwardBatch, SeqSlice
from hicache.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32 like the reference implementations, then back to the activation dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Prefill queries are attended in pieces of this many rows (a multiple of Q_ALIGN), each over only the
# keys it can see.
Q_PIECE = 512


class RotaryEmbedding:
    def __init__(self, head_dim: int, theta: float, max_position: int, dtype: torch.dtype, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return x * cos + rotate_half(x) * sin


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, pctx: ParallelContext, cast):
        kv0, kv1 = pctx.shard_range(cfg.num_kv_heads, "num_kv_heads")
        group = cfg.num_heads // cfg.num_kv_heads
        q0, q1 = kv0 * group, kv1 * group
        d = cfg.head_dim
        f0, f1 = pctx.shard_range(cfg.intermediate_size, "intermediate_size")
        a = prefix + "self_attn."
        m = prefix + "mlp."
        self.num_heads = q1 - q0
        self.num_kv_heads = kv1 - kv0
        self.head_dim = d
        self.input_norm = cast(w[prefix + "input_layernorm.weight"])
        self.post_norm = cast(w[prefix + "post_attention_layernorm.weight"])
        self.q_proj = cast(w[a + "q_proj.weight"][q0 * d : q1 * d])
        self.k_proj = cast(w[a + "k_proj.weight"][kv0 * d : kv1 * d])
        self.v_proj = cast(w[a + "v_proj.weight"][kv0 * d : kv1 * d])
        self.o_proj = cast(w[a + "o_proj.weight"][:, q0 * d : q1 * d])
        # gate and up share the input: one matmul instead of two.
        self.gate_up = cast(torch.cat([w[m + "gate_proj.weight"][f0:f1], w[m + "up_proj.weight"][f0:f1]]))
        self.down_proj = cast(w[m + "down_proj.weight"][:, f0:f1])


class LlamaModel:
    """One rank's slice of the decoder. `forward` takes token ids on the first stage and hidden states
    on later ones; it returns logits for `batch.logit_rows` on the last stage, hidden states otherwise."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        pctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.pctx = pctx
        self.dtype = dtype
        self.device = device
        self.layer_start, self.layer_end = pctx.layer_range(cfg.num_layers)

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        self.layers = [
            LlamaLayer(cfg, weights, f"model.layers.{i}.", pctx, cast) for i in range(self.layer_start, self.layer_end)
        ]
        self.embed = cast(weights["model.embed_tokens.weight"]) if pctx.is_first_stage else None
        if pctx.is_last_stage:
            self.norm = cast(weights["model.norm.weight"])
            head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
            self.lm_head = cast(head)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position, dtype, device)
        self.scale = cfg.head_dim**-0.5
        self.kv_layout = KVLayout.mha(self.layers[0].num_kv_heads, cfg.head_dim)

    @property
    def num_local_layers(self) -> int:
        return len(self.layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: DeviceKVPool, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            assert self.embed is not None, "only the first pipeline stage embeds tokens"
            hidden = self.embed[batch.input_ids]
        decode, others = batch.split(self.device)
        for local, layer in enumerate(self.layers):
            if batch.before_layer is not None:
                batch.before_layer(local)
            hidden = self._layer(local, layer, hidden, batch, pool, decode, others)
        if not self.pctx.is_last_stage:
            return hidden
        rows = rms_norm(hidden[batch.logit_rows], self.norm, self.cfg.rms_norm_eps)
        return F.linear(rows, self.lm_head).float()

    def _layer(
        self,
        local: int,
        layer: LlamaLayer,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        pool: DeviceKVPool,
        decode: DecodeGroup | None,
        others: list[SeqSlice],
    ) -> torch.Tensor:
        T = hidden.shape[0]
        d = layer.head_dim
        x = rms_norm(hidden, layer.input_norm, self.cfg.rms_norm_eps)
        q = self.rope(F.linear(x, layer.q_proj).view(T, layer.num_heads, d), batch.positions)
        k = self.rope(F.linear(x, layer.k_proj).view(T, layer.num_kv_heads, d), batch.positions)
        v = F.linear(x, layer.v_proj).view(T, layer.num_kv_heads, d)
        pool.write(local, batch.out_slots, {"k": k, "v": v})
        attn = torch.empty(T, layer.num_heads, d, dtype=hidden.dtype, device=hidden.device)
        if decode is not None:
            attn[decode.rows] = self._attend_decode(local, q[decode.rows], decode, pool)
        for seq in others:
            rows = slice(seq.start, seq.start + seq.length)
            attn[rows] = self._attend(local, q[rows], seq.kv_slots, seq.kv_len, pool)
        out = self.pctx.all_reduce_tp(F.linear(attn.view(T, -1), layer.o_proj))
        hidden = hidden + out
        x = rms_norm(hidden, layer.post_norm, self.cfg.rms_norm_eps)
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        mlp = self.pctx.all_reduce_tp(F.linear(F.silu(gate) * up, layer.down_proj))
        return hidden + mlp

    def _attend_decode(self, local: int, q: torch.Tensor, group: DecodeGroup, pool: DeviceKVPool) -> torch.Tensor:
        """One query per sequence, B sequences in one call. Each query is padded to Q_ALIGN rows and
        each sequence's keys to the group's length (masked), so every row sees exactly the kernel
        shapes it would see alone: the result is bitwise the one `_attend` gives."""
        B = q.shape[0]
        kv = pool.read(local, group.slots)
        k = kv["k"].view(B, group.length, *kv["k"].shape[1:]).transpose(1, 2)
        v = kv["v"].view(B, group.length, *kv["v"].shape[1:]).transpose(1, 2)
        # Materialized, not a stride-0 view: the kernel's result can depend on the operands' strides.
        queries = q.unsqueeze(2).expand(-1, -1, Q_ALIGN, -1).contiguous()
        out = F.scaled_dot_product_attention(queries, k, v, attn_mask=group.mask, scale=self.scale, enable_gqa=True)
        return out[:, :, 0]

    def _attend(
        self, local: int, q: torch.Tensor, kv_slots: torch.Tensor, kv_len: int, pool: DeviceKVPool
    ) -> torch.Tensor:
        """Causal attention of n new queries over the request's kv_len = prefix + n keys (kv_slots may
        carry masked padding beyond kv_len). Queries go in pieces of Q_PIECE rows, each over only the
        KV_ALIGN-aligned keys it can see: a masked kernel does not skip blocks above the diagonal, so
        this halves a fresh prefill's attention work, and it cannot change a bit (a query's result
        does not depend on fully masked trailing key blocks, nor on the other rows of its call)."""
        kv = pool.read(local, kv_slots)
        n = q.shape[0]
        first = kv_len - n  # position of query 0
        pieces = []
        for a in range(0, n, Q_PIECE):
            b = min(n, a + Q_PIECE)
            keys = -(-(first + b) // KV_ALIGN) * KV_ALIGN
            pieces.append(self._attend_rows(q[a:b], kv["k"][:keys], kv["v"][:keys], first + a))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int) -> torch.Tensor:
        """Queries at positions first.. over keys [0, len(k)), causal."""
        n = q.shape[0]
        rows = -(-n // Q_ALIGN) * Q_ALIGN
        # Query i sits at position first + i and sees keys 0..first + i; padding is never seen.
        mask = torch.ones(n, k.shape[0], dtype=torch.bool, device=q.device).tril(first)
        if rows > n:  # padding rows repeat the last query and its mask; their outputs are dropped
            q = torch.cat([q, q[-1:].expand(rows - n, -1, -1)])
            mask = torch.cat([mask, mask[-1:].expand(rows - n, -1)])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)[:n]
