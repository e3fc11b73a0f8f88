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

ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's activation on its gate columns (kernels/activations.py)


@dataclass(frozen=True)
class LayerParts:
    """Which of the shared layer parts a family's decoder is built from, beyond Llama's (the default):
    what a checkpoint family's config says (hicache/model/families/checkpoints.py), what the decoder reads
    (families/llama.py), and what a fused native path must accept before it stands in for the Python one
    (kernels/fused_layer.py).

    - `qkv_bias`: q, k and v projections add biases (Qwen2);
    - `qk_norm`: an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3);
    - `sandwich_norms`: attention's and the MLP's outputs are normed before their residual adds, and the
      MLP's input by `pre_feedforward_layernorm` (Gemma 2 and 3);
    - `activation`: the gated MLP's, one of ACTIVATIONS;
    - `embedding_scale`: the embedding rows are multiplied by it (Gemma: sqrt(hidden_size));
    - `attention_scale`: the scores' scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5);
    - `final_logit_softcap`: logits = cap * tanh(logits / cap) (Gemma 2);
    - `local_rope_theta`: the RoPE base of sliding-window layers (None: rope_theta; Gemma 3: 10,000).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embedding_scale: float = 1.0
    attention_scale: float | None = None
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")


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
    parts: LayerParts = LayerParts()

    @property
    def attention_scale(self) -> float:
        return self.parts.attention_scale or self.head_dim**-0.5

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
