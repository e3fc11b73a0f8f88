"""Phi-3 / Phi-4: Llama's layers with q, k and v in one stored projection (`self_attn.qkv_proj`, llama.cpp's
`attn_qkv`) and gate and up in another (`mlp.gate_up_proj`, llama.cpp's `ffn_up`), split here into Llama's
names (rows, so a GGUF's quantized codes split alike)."""

from __future__ import annotations

from typing import Any

from hicache.model.families.checkpoint import CheckpointFamily, HFConfig


def _split(weights: dict[str, Any], hf_config: HFConfig) -> dict[str, Any]:
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    q_rows = heads * head_dim
    kv_rows = int(hf_config.get("num_key_value_heads") or heads) * head_dim
    out = {}
    for name, tensor in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            a = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor[:q_rows], tensor[q_rows : q_rows + kv_rows], tensor[q_rows + kv_rows :]
            out |= {a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v}
        elif name.endswith("mlp.gate_up_proj.weight"):
            m = name.removesuffix("gate_up_proj.weight")
            half = tensor.shape[0] // 2
            gate, up = tensor[:half], tensor[half:]
            out |= {m + "gate_proj.weight": gate, m + "up_proj.weight": up}
        else:
            out[name] = tensor
    return out


def _refusal(hf_config: HFConfig) -> str | None:
    rope = hf_config.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor") or hf_config.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        return f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported"
    return None


PHI3 = CheckpointFamily("Phi-3", weights=_split, refusal=_refusal, gguf_arch="phi3", gguf_weights=_split,
                        gguf_names=(("attn_qkv.weight", "self_attn.qkv_proj.weight"),
                                    ("ffn_up.weight", "mlp.gate_up_proj.weight")))  # fmt: skip
