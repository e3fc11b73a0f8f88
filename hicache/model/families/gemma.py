"""Gemma 2 and Gemma 3 (text): RMSNorms that scale by 1 + w (folded into the weights here), norms of
attention's and the MLP's outputs before their residual adds, GELU (tanh) gated MLPs, embeddings scaled
by sqrt(hidden_size), scores scaled by query_pre_attn_scalar ** -0.5, interleaved sliding-window and
global layers (Gemma 3's sliding layers with a RoPE base of their own), Gemma 3's QK-norm and Gemma 2's
final logit soft-capping."""

from __future__ import annotations

import torch

from hicache.model.config import LayerParts
from hicache.model.families import hybrid
from hicache.model.families.checkpoint import CheckpointFamily, HFConfig


def _parts(hf_config: HFConfig, qk_norm: bool) -> LayerParts:
    hidden = int(hf_config["hidden_size"])
    scalar = hf_config.get("query_pre_attn_scalar")
    local = (hf_config.get("rope_parameters") or {}).get(hybrid.SLIDING) or {}
    local_theta = local.get("rope_theta") or hf_config.get("rope_local_base_freq")
    cap = hf_config.get("final_logit_softcapping")
    return LayerParts(
        qk_norm=qk_norm,
        sandwich_norms=True,
        activation=_activation(hf_config),
        embedding_scale=hidden**0.5,
        attention_scale=float(scalar) ** -0.5 if scalar else None,
        final_logit_softcap=float(cap) if cap else None,
        local_rope_theta=float(local_theta) if local_theta else None,
    )


def _activation(hf_config: HFConfig) -> str:
    name = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_tanh" if name in ("gelu_pytorch_tanh", "gelu_tanh") else name


def _one_plus_norms(weights: dict[str, torch.Tensor], hf_config: HFConfig) -> dict[str, torch.Tensor]:
    """Gemma's RMSNorm multiplies by 1 + w: the decoder's multiplies by its weight, so the weight is 1 + w."""
    return {name: t + 1.0 if name.endswith("norm.weight") else t for name, t in weights.items()}


def _refusal(hf_config: HFConfig) -> str | None:
    if hf_config.get("attn_logit_softcapping"):
        return "attention logit soft-capping (attn_logit_softcapping) is not supported by the attention kernels"
    return None


def _layer_types(hf_config: HFConfig, every: int) -> tuple[str, ...]:
    """Configs saved before transformers listed `layer_types` imply them: every `every`-th layer is global."""
    listed = tuple(hf_config.get("layer_types") or ())
    if listed:
        return listed
    every = int(hf_config.get("sliding_window_pattern") or every)
    layers = int(hf_config["num_hidden_layers"])
    return tuple(hybrid.FULL if (i + 1) % every == 0 else hybrid.SLIDING for i in range(layers))


def _gguf_config(hf_config: HFConfig, largest_layers: int) -> HFConfig:
    """What llama.cpp infers for a Gemma GGUF rather than reads: the score scale is head_dim ** -0.5, but
    (hidden / heads) ** -0.5 for the 27B models (known by their layer count), and Gemma 3's sliding layers
    rotate by a base of 10,000."""
    largest = int(hf_config["num_hidden_layers"]) == largest_layers
    scalar = (
        int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"]) if largest else hf_config["head_dim"]
    )
    return {"query_pre_attn_scalar": scalar, "rope_local_base_freq": hf_config.get("rope_local_base_freq") or 10000.0}


# llama.cpp's names of Gemma's norms: its `ffn_norm` is the MLP's input norm, as in Llama.
_GGUF_NAMES = (("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
               ("post_attention_norm.weight", "post_attention_layernorm.weight"),
               ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"))  # fmt: skip

GEMMA2 = CheckpointFamily("Gemma 2", parts=lambda c: _parts(c, qk_norm=False), weights=_one_plus_norms,
                          refusal=_refusal, layer_types=lambda c: _layer_types(c, every=2), gguf_arch="gemma2",
                          gguf_config=lambda c: {**_gguf_config(c, 46), "rope_local_base_freq": None},
                          gguf_names=_GGUF_NAMES)  # fmt: skip
GEMMA3 = CheckpointFamily("Gemma 3", parts=lambda c: _parts(c, qk_norm=True), weights=_one_plus_norms,
                          refusal=_refusal, layer_types=lambda c: _layer_types(c, every=6), gguf_arch="gemma3",
                          gguf_config=lambda c: _gguf_config(c, 62), gguf_names=_GGUF_NAMES)  # fmt: skip
