"""Qwen2 / Qwen2.5 (biases on the q, k and v projections) and Qwen3 (an RMSNorm over each query and key
head before RoPE): Llama's layers otherwise, under Llama's weight names."""

from __future__ import annotations

from hicache.model.config import LayerParts
from hicache.model.families.checkpoint import CheckpointFamily

QWEN2 = CheckpointFamily("Qwen2", parts=lambda hf_config: LayerParts(qkv_bias=True), gguf_arch="qwen2")
QWEN3 = CheckpointFamily("Qwen3", parts=lambda hf_config: LayerParts(qk_norm=True), gguf_arch="qwen3")
