"""Model architecture description shared by every loader (tiny, GGUF, Hugging Face directory).

A loader turns its source into a `ModelConfig`, a dict of full (unsharded) float32 weights named as
Hugging Face's Llama names them, and a tokenizer. The decoder (`families/llama.py`) slices those weights for
its tensor- and pipeline-parallel rank, so loaders never need to know the topology.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache.model.kernels.quant import QuantizedWeight
from hicache.model.rope import RopeScaling
from hicache.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. `head_dim` may differ from hidden_size // num_heads.

    `max_position` is the context served by default; `context_limit` the most `--context-length` may raise it
    to (None: max_position). A checkpoint's positions stop where it was trained (or its RoPE scaling
    stretches them, hicache/model/rope.py); the built-in models' seeded weights were trained at no length
    and RoPE computes any position, so they default to 4,096 and allow 1,048,576.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    context_limit: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


@dataclass
class LoadedModel:
    """What a loader hands to the engine.

    `weights` uses Hugging Face Llama names: `model.embed_tokens.weight`,
    `model.layers.{i}.input_layernorm.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
    `model.layers.{i}.post_attention_layernorm.weight`, `model.layers.{i}.mlp.{gate,up,down}_proj.weight`,
    `model.norm.weight` and, when embeddings are untied, `lm_head.weight`. Tensors are float32 on the
    CPU with the (out_features, in_features) orientation of `torch.nn.Linear`, and q/k projections in
    Hugging Face's rotary order (rotate-half), not llama.cpp's interleaved one.

    `identity` is a digest of the weights' source (file bytes, or the seed for `tiny`): storage keys
    are namespaced by it, so KV computed by one model is never served to another.

    `quantized` holds, under the same names, the integer codes of the tensors the checkpoint stores
    quantized (a GGUF's Q4_1 and Q8_0 blocks), for weight-only quantized matmuls (`--quantization`);
    `weights` holds their dequantized values all the same.

    `family` names the decoder it is built as (hicache/model/families/registry.py): a Llama unless the
    loader says otherwise.
    """

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    identity: str
    extra: dict[str, object] = field(default_factory=dict)
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    family: str = "llama"
