"""`tiny`: a built-in Llama with seeded random weights and the byte tokenizer, small enough that the
whole test suite runs fast on two cores while exercising every code path of the real models (GQA,
several layers to split over PP, KV heads to split over TP)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import torch

from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.tokenizer import ByteTokenizer

TINY_CONFIG = ModelConfig(
    vocab_size=258,
    # Every projection (also when split over TP2) has at least 32 outputs and 64 inputs: smaller
    # matrices take a different bf16 GEMM kernel for large batches, whose rows then differ in the
    # last bit from small batches (see tests/model/test_batch_invariance.py).
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=4096,
    tie_word_embeddings=False,
    context_limit=1 << 20,  # --context-length may ask for up to 1,048,576 positions (ModelConfig)
)
TINY_SEED = 1234


def tiny_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(cfg.vocab_size, h, scale=1.0)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + randn(h, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + randn(h, scale=0.1)
        w[p + "self_attn.q_proj.weight"] = randn(cfg.num_heads * d, h, scale=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = randn(cfg.num_kv_heads * d, h, scale=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = randn(cfg.num_kv_heads * d, h, scale=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = randn(h, cfg.num_heads * d, scale=(cfg.num_heads * d) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = randn(f, h, scale=h**-0.5)
        w[p + "mlp.up_proj.weight"] = randn(f, h, scale=h**-0.5)
        w[p + "mlp.down_proj.weight"] = randn(h, f, scale=f**-0.5)
    w["model.norm.weight"] = torch.ones(h)
    # A sharp output head makes greedy choices well separated, so the model's text is deterministic
    # but not degenerate (it does not collapse onto one token).
    w["lm_head.weight"] = randn(cfg.vocab_size, h, scale=4.0 * h**-0.5)
    return w


def load_tiny() -> LoadedModel:
    identity = hashlib.sha256(json.dumps({"config": asdict(TINY_CONFIG), "seed": TINY_SEED}).encode()).hexdigest()
    return LoadedModel(
        name="tiny",
        config=TINY_CONFIG,
        weights=tiny_weights(TINY_CONFIG, TINY_SEED),
        tokenizer=ByteTokenizer(),
        identity=identity,
    )
