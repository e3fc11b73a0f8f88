"""Checks shared by the checkpoint loaders (GGUF, Hugging Face directory): the exact set of weight names
and shapes a `ModelConfig` implies, so a malformed or unsupported checkpoint fails at load time with one
clear line instead of deep inside the forward pass; and the tail both loaders end with."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Iterable, Sequence

import torch

from hicache.errors import UserError
from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.kernels.quant import QuantizedWeight
from hicache.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_HASH_CHUNK = 1 << 22


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama weight names -> (out_features, in_features) shapes for `config`."""
    d, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_out)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, d)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, d)
        shapes[p + "mlp.down_proj.weight"] = (d, config.intermediate_size)
        shapes.update(_parts_shapes(config, p))
    return shapes


def _parts_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The weights layer `p`'s LayerParts add (hicache/model/config.py)."""
    parts, d, hd = config.parts, config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if parts.qkv_bias:
        shapes |= {p + "self_attn.q_proj.bias": (config.num_heads * hd,),
                   p + "self_attn.k_proj.bias": (config.num_kv_heads * hd,),
                   p + "self_attn.v_proj.bias": (config.num_kv_heads * hd,)}  # fmt: skip
    if parts.qk_norm:
        shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    if parts.sandwich_norms:
        shapes |= {p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)}
    return shapes


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    """Raise UserError unless `weights` holds exactly the expected names with the expected shapes."""
    expected = expected_weight_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise UserError(f"{source}: missing weights {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    unexpected = sorted(weights.keys() - expected.keys())
    if unexpected:
        raise UserError(
            f"{source}: unsupported weights {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''} "
            "(not a checkpoint of its family's shape)"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise UserError(f"{source}: weight {name} has shape {tuple(weights[name].shape)}, expected {shape}")


def sha256_files(paths: Iterable[str | os.PathLike[str]]) -> str:
    """Hex SHA-256 over the files' bytes in the given order, read in chunks so memory stays flat."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def check_vocab(tokenizer_vocab: int, config: ModelConfig, source: str) -> None:
    """A tokenizer that emits ids the embedding has no row for would index out of range at run time."""
    if tokenizer_vocab > config.vocab_size:
        raise UserError(f"{source}: tokenizer has {tokenizer_vocab} tokens, the embedding {config.vocab_size}")


def checked_model(
    name: str,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    files: Sequence[str | os.PathLike[str]],
    source: str,
    started: float,
    quantized: dict[str, QuantizedWeight] | None = None,
    **extra: object,
) -> LoadedModel:
    """The tail every file loader shares: the tokenizer must fit the embedding, the identity is the
    digest of the files' bytes, one log line, and the LoadedModel (`extra` beside source and context)."""
    check_vocab(tokenizer.vocab_size, config, source)
    identity = sha256_files(files)
    logger.info("loaded %s (%d tensors) in %.2f s", source, len(weights), time.perf_counter() - started)
    return LoadedModel(
        name=name,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        identity=identity,
        extra={"source": source, "context_length": config.max_position, **extra},
        quantized=quantized or {},
    )
