"""`tiny-mla`: a built-in MLA decoder (hicache/model/families/mla.py) with seeded random weights and the byte
tokenizer, the size of `tiny`, for the tests of a latent KV: its own KV layout (one 80-element row per
token per layer), and pages sharded over attention-TP ranks when CP is off."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import torch

from hicache.model.config import LoadedModel
from hicache.model.families.mla import FAMILY, MLAConfig
from hicache.model.families.tiny import TINY_CONFIG, tiny_weights
from hicache.model.tokenizer import ByteTokenizer

TINY_MLA_CONFIG = MLAConfig(
    vocab_size=TINY_CONFIG.vocab_size,
    hidden_size=TINY_CONFIG.hidden_size,
    intermediate_size=TINY_CONFIG.intermediate_size,
    num_layers=TINY_CONFIG.num_layers,
    num_heads=4,
    num_kv_heads=4,  # every head reads the one latent; heads split over TP like query heads
    head_dim=32,  # 16 without rope + 16 rotary
    rope_theta=TINY_CONFIG.rope_theta,
    rms_norm_eps=TINY_CONFIG.rms_norm_eps,
    max_position=TINY_CONFIG.max_position,
    tie_word_embeddings=False,
    context_limit=TINY_CONFIG.context_limit,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
)
TINY_MLA_SEED = 4321


def tiny_mla_weights(cfg: MLAConfig, seed: int) -> dict[str, torch.Tensor]:
    """tiny's embedding, norms, MLP and head (its recipe), with MLA attention weights in their place.
    Every projection, also split over TP2, keeps tiny's minimum shapes (32 outputs, 64 inputs)."""
    w = {k: v for k, v in tiny_weights(cfg, seed).items() if ".self_attn." not in k}
    gen = torch.Generator().manual_seed(seed + 1)
    h, d, r, rope = cfg.hidden_size, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, heads = d - rope, cfg.num_heads

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        w[a + "q_proj.weight"] = randn(heads * d, h, scale=h**-0.5)
        w[a + "kv_a_proj_with_mqa.weight"] = randn(r + rope, h, scale=h**-0.5)
        w[a + "kv_a_layernorm.weight"] = 1.0 + randn(r, scale=0.1)
        w[a + "kv_b_proj.weight"] = randn(heads * (nope + d), r, scale=r**-0.5)
        w[a + "o_proj.weight"] = randn(h, heads * d, scale=(heads * d) ** -0.5)
    return w


def load_tiny_mla() -> LoadedModel:
    identity = hashlib.sha256(
        json.dumps({"config": asdict(TINY_MLA_CONFIG), "seed": TINY_MLA_SEED}).encode()
    ).hexdigest()
    return LoadedModel(
        name="tiny-mla",
        config=TINY_MLA_CONFIG,
        weights=tiny_mla_weights(TINY_MLA_CONFIG, TINY_MLA_SEED),
        tokenizer=ByteTokenizer(),
        identity=identity,
        family=FAMILY,
    )
