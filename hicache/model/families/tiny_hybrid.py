"""`tiny-hybrid`: a built-in hybrid decoder (hicache/model/families/hybrid.py) with seeded random weights and
the byte tokenizer, the size of `tiny`: sliding-window layers (a 64-token window, four 16-token pages), a
gated linear-attention layer with a recurrent state, and a full-attention layer, for the tests of what a
prefix cache must keep of a hybrid model."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, fields

import torch

from hicache.model.config import LoadedModel
from hicache.model.families.hybrid import FAMILY, FULL, LINEAR, SLIDING, HybridConfig, linear_attention_names
from hicache.model.families.tiny import TINY_CONFIG, tiny_weights
from hicache.model.tokenizer import ByteTokenizer

TINY_HYBRID_CONFIG = HybridConfig(
    **{f.name: getattr(TINY_CONFIG, f.name) for f in fields(TINY_CONFIG)},
    layer_types=(SLIDING, LINEAR, SLIDING, FULL),
    sliding_window=64,
    linear_num_heads=2,
    linear_head_dim=16,
)
TINY_HYBRID_SEED = 2468
# The gate's bias: sigmoid(3) = 0.95, so a token's share of the state fades over about twenty tokens, and
# the state after a page still carries the page before it.
GATE_BIAS = 3.0


def tiny_hybrid_weights(cfg: HybridConfig, seed: int) -> dict[str, torch.Tensor]:
    """tiny's recipe for every layer, with a linear-attention layer's projections in place of its
    attention's where `layer_types` says so."""
    w = tiny_weights(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    h, inner = cfg.hidden_size, cfg.linear_num_heads * cfg.linear_head_dim
    for i, kind in enumerate(cfg.layer_types):
        if kind != LINEAR:
            continue
        for name in [n for n in w if n.startswith(f"model.layers.{i}.self_attn.")]:
            del w[name]
        names = linear_attention_names(i)
        for p in ("q_proj", "k_proj", "v_proj"):
            w[names[p]] = torch.randn(inner, h, generator=gen) * h**-0.5
        w[names["g_proj"]] = torch.randn(cfg.linear_num_heads, h, generator=gen) * 0.3 * h**-0.5
        w[names["o_proj"]] = torch.randn(h, inner, generator=gen) * inner**-0.5
        w[names["gate_bias"]] = torch.full((cfg.linear_num_heads,), GATE_BIAS)
    return w


def load_tiny_hybrid() -> LoadedModel:
    identity = hashlib.sha256(
        json.dumps({"config": asdict(TINY_HYBRID_CONFIG), "seed": TINY_HYBRID_SEED}).encode()
    ).hexdigest()
    return LoadedModel(
        name="tiny-hybrid",
        config=TINY_HYBRID_CONFIG,
        weights=tiny_hybrid_weights(TINY_HYBRID_CONFIG, TINY_HYBRID_SEED),
        tokenizer=ByteTokenizer(),
        identity=identity,
        family=FAMILY,
    )
