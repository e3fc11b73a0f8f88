"""A checkpoint's config as config.json's keys -> the ModelConfig its family's decoder is built from, for both
loaders (a GGUF's metadata is read into the same keys, hicache/model/loading/gguf_loader.py): the family
(hicache/model/families/registry.py) and what it refuses, its layer parts, and where layers slide, the
hybrid decoder's config."""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from typing import Any

from hicache.errors import UserError
from hicache.model import rope
from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.families import hybrid
from hicache.model.families.checkpoint import CheckpointFamily, HFConfig

logger = logging.getLogger(__name__)


def family_named(families: dict[str, CheckpointFamily], key: Any, what: str, hint: str = "") -> CheckpointFamily:
    """The family `key` names in `families`, refused in one line where it is unknown."""
    family = families.get(key)
    if family is None:
        raise UserError(f"{what} {key!r} is not supported{hint} (supported: {', '.join(families)})")
    return family


def refuse_unsupported(family: CheckpointFamily, hf_config: HFConfig, where: str) -> None:
    """One line where the config asks for what the decoder does not compute."""
    reason = family.refusal(hf_config)
    if reason is not None:
        raise UserError(f"{where}: {family.name}: {reason}")
    if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):  # Llama's: o_proj's and the MLP's too
        raise UserError(f"{where}: output and MLP projections with biases are not supported")


def with_decoder_family(loaded: LoadedModel) -> LoadedModel:
    """`loaded` built as the hybrid decoder where its config has sliding layers (the Llama one otherwise)."""
    return replace(loaded, family=hybrid.FAMILY) if isinstance(loaded.config, hybrid.HybridConfig) else loaded


def model_config(hf_config: HFConfig, family: CheckpointFamily, theta: float, scaling: rope.RopeScaling | None,
                 where: str) -> ModelConfig:  # fmt: skip
    """Raises KeyError for a missing key, TypeError or ValueError for an invalid one (the loader words it)."""
    hidden = int(hf_config["hidden_size"])
    num_heads = int(hf_config["num_attention_heads"])
    max_position = rope.scaled_context(int(hf_config["max_position_embeddings"]), scaling)
    # Qwen2 writes a window it does not use unless use_sliding_window.
    sliding_window = None if hf_config.get("use_sliding_window") is False else hf_config.get("sliding_window")
    layer_types = family.layer_types(hf_config)
    # Where layer_types names the sliding layers the hybrid decoder attends over the window in them.
    if sliding_window and int(sliding_window) < max_position and hybrid.SLIDING not in layer_types:
        # Full attention equals sliding-window attention up to the window, so cap the context there.
        logger.info("%s: context capped at the sliding window, %d tokens", where, sliding_window)
        max_position = int(sliding_window)
    config = ModelConfig(
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf_config["intermediate_size"]),
        num_layers=int(hf_config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or num_heads),
        head_dim=int(hf_config.get("head_dim") or hidden // num_heads),
        rope_theta=theta,
        rms_norm_eps=float(hf_config.get("rms_norm_eps") or 1e-6),
        max_position=max_position,
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        parts=family.parts(hf_config),
    )
    return _hybrid(config, layer_types, sliding_window, where) if layer_types else config


def _hybrid(config: ModelConfig, layer_types: tuple[str, ...], window: Any, where: str) -> ModelConfig:
    """`config` with its `layer_types`: a hybrid where some layers slide (a plain Llama where all are full)."""
    if set(layer_types) <= {hybrid.FULL}:
        return config
    if hybrid.LINEAR in layer_types:
        raise UserError(f"{where}: linear_attention layers are not supported from a checkpoint (only tiny-hybrid's)")
    if not window:
        raise UserError(f"{where}: the config lists sliding_attention layers but no sliding_window")
    shape = {f.name: getattr(config, f.name) for f in fields(config)}
    return hybrid.HybridConfig(**shape, layer_types=layer_types, sliding_window=int(window))
