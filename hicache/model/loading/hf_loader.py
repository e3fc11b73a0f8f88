"""Loader for a local Hugging Face model directory (config.json, *.safetensors, tokenizer.json,
tokenizer_config.json), strictly offline.

Its `model_type` names a checkpoint family (hicache/model/families/registry.py, CHECKPOINT_FAMILIES: Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3): the family says which layer parts the config implies and
maps its weights onto the decoder's names; they are cast to float32. A config whose `layer_types` lists
`sliding_attention` layers (transformers' per-layer field, with `sliding_window`) loads as a hybrid
decoder (hicache/model/families/hybrid.py) that attends over the window in those layers.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from dataclasses import fields, replace
from typing import Any

import tokenizers
import torch
from safetensors import SafetensorError, safe_open

from hicache.errors import UserError
from hicache.model import rope
from hicache.model.chat import ChatTemplate
from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.families import hybrid
from hicache.model.families.checkpoint import CheckpointFamily
from hicache.model.families.registry import CHECKPOINT_FAMILIES
from hicache.model.loading.checkpoint import check_weights, checked_model
from hicache.model.loading.hf_tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

_SHARD_INDEX = "model.safetensors.index.json"
# Buffers some old checkpoints saved alongside the weights; the decoder computes them itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_dir(path: str | os.PathLike[str], name: str) -> LoadedModel:
    """Load a Hugging Face directory of a known family as float32 weights plus its tokenizer and chat template."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise UserError(f"Hugging Face model directory not found: {root}")
    started = time.perf_counter()
    config_path = root / "config.json"
    hf_config = _read_json(config_path, required=True)
    family = _family(hf_config, root)
    config = _config(hf_config, family, root)

    files = _safetensors_files(root)
    weights = family.weights(_read_weights(files), hf_config)
    if config.tie_word_embeddings:
        # Some tied checkpoints still store a copy of the embedding as lm_head; the contract omits it.
        weights.pop("lm_head.weight", None)
    check_weights(weights, config, str(root))

    loaded = checked_model(
        name,
        config,
        weights,
        _tokenizer(root, hf_config),
        [config_path, *files],
        str(root),
        started,
        model_type=hf_config["model_type"],
    )
    return replace(loaded, family=hybrid.FAMILY) if isinstance(config, hybrid.HybridConfig) else loaded


def _read_json(path: pathlib.Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise UserError(f"{path} not found")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a JSON object")
    return data


def _rope(hf_config: dict[str, Any], max_position: int, root: pathlib.Path) -> tuple[float, rope.RopeScaling | None]:
    """rope_theta and the RoPE scaling. transformers 5 writes `rope_parameters` (rope_type, rope_theta and
    the scaling's fields; per layer type where they differ, the global layers' here); older versions write
    `rope_theta` and `rope_scaling`."""
    params = {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}
    params = params.get(hybrid.FULL, params)
    theta = float(params.get("rope_theta") or hf_config.get("rope_theta") or 10000.0)
    return theta, rope.from_hf(params, max_position, f"{root}/config.json")


def _family(hf_config: dict[str, Any], root: pathlib.Path) -> CheckpointFamily:
    model_type = hf_config.get("model_type")
    family = CHECKPOINT_FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        hint = " (serve its text model: model_type gemma3_text)" if "text_config" in hf_config else ""
        raise UserError(f"{root}: model_type {model_type!r} is not supported{hint} "
                        f"(supported: {', '.join(CHECKPOINT_FAMILIES)})")  # fmt: skip
    reason = family.refusal(hf_config)
    if reason is not None:
        raise UserError(f"{root}: {family.name}: {reason}")
    if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):  # Llama's: o_proj's and the MLP's too
        raise UserError(f"{root}: output and MLP projections with biases are not supported")
    return family


def _config(hf_config: dict[str, Any], family: CheckpointFamily, root: pathlib.Path) -> ModelConfig:
    try:
        hidden = int(hf_config["hidden_size"])
        num_heads = int(hf_config["num_attention_heads"])
        max_position = int(hf_config["max_position_embeddings"])
        theta, scaling = _rope(hf_config, max_position, root)
        max_position = rope.scaled_context(max_position, scaling)
        # Qwen2 writes a window it does not use unless use_sliding_window.
        sliding_window = None if hf_config.get("use_sliding_window") is False else hf_config.get("sliding_window")
        layer_types = family.layer_types(hf_config)
        # Where layer_types names the sliding layers the hybrid decoder attends over the window in them.
        if sliding_window and int(sliding_window) < max_position and hybrid.SLIDING not in layer_types:
            # Full attention equals sliding-window attention up to the window, so cap the context there.
            logger.info("%s: context capped at the sliding window, %d tokens", root, sliding_window)
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
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            max_position=max_position,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            parts=family.parts(hf_config),
        )
        return _hybrid(config, layer_types, sliding_window, root) if layer_types else config
    except KeyError as exc:
        raise UserError(f"{root}/config.json lacks {exc.args[0]}") from exc
    except (TypeError, ValueError) as exc:
        raise UserError(f"{root}/config.json is invalid: {exc}") from exc


def _hybrid(config: ModelConfig, layer_types: tuple[str, ...], window: Any, root: pathlib.Path) -> ModelConfig:
    """`config` with its `layer_types`: a hybrid where some layers slide (a plain Llama where all are full)."""
    if set(layer_types) <= {hybrid.FULL}:
        return config
    if hybrid.LINEAR in layer_types:
        raise UserError(f"{root}: linear_attention layers are not supported from a checkpoint (only tiny-hybrid's)")
    if not window:
        raise UserError(f"{root}/config.json lists sliding_attention layers but no sliding_window")
    shape = {f.name: getattr(config, f.name) for f in fields(config)}
    return hybrid.HybridConfig(**shape, layer_types=layer_types, sliding_window=int(window))


def _safetensors_files(root: pathlib.Path) -> list[pathlib.Path]:
    index = _read_json(root / _SHARD_INDEX)
    if index:
        names = sorted(set(index.get("weight_map", {}).values()))
        files = [root / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{root}: shards listed in {_SHARD_INDEX} are missing: {missing}")
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise UserError(f"{root}: no *.safetensors weights (other formats are not supported)")
    return files


def _read_weights(files: list[pathlib.Path]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if not key.endswith(_IGNORED_SUFFIXES):
                        weights[key] = f.get_tensor(key).to(torch.float32)
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{file} is not a readable safetensors file: {exc}") from exc
    return weights


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens either as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _chat_template_source(root: pathlib.Path, tokenizer_config: dict[str, Any]) -> str | None:
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        # Several named templates: the "default" one is what apply_chat_template uses.
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str):
        return source
    # transformers >= 4.43 saves the template beside tokenizer_config.json instead.
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    source = _read_json(root / "chat_template.json").get("chat_template")
    return source if isinstance(source, str) else None


def _tokenizer(root: pathlib.Path, hf_config: dict[str, Any]) -> HFTokenizer:
    tokenizer_path = root / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise UserError(f"{tokenizer_path} not found (only fast tokenizers are supported)")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files.
        raise UserError(f"{tokenizer_path} is not a readable tokenizer: {exc}") from exc
    tokenizer_config = _read_json(root / "tokenizer_config.json")
    generation_config = _read_json(root / "generation_config.json")

    bos_text = _token_content(tokenizer_config.get("bos_token"))
    bos_id = tokenizer.token_to_id(bos_text) if bos_text is not None else None
    if bos_id is None and (config_bos := _ids(hf_config.get("bos_token_id"))):
        bos_id = config_bos[0]
        bos_text = tokenizer.id_to_token(bos_id)

    eos_text = _token_content(tokenizer_config.get("eos_token"))
    eos_ids: list[int] = []
    if eos_text is not None and (eos_id := tokenizer.token_to_id(eos_text)) is not None:
        eos_ids.append(eos_id)
    eos_ids += _ids(hf_config.get("eos_token_id")) + _ids(generation_config.get("eos_token_id"))
    if eos_text is None and eos_ids:
        eos_text = tokenizer.id_to_token(eos_ids[0])

    source = _chat_template_source(root, tokenizer_config)
    template = (
        ChatTemplate(source, bos_token=bos_text or "", eos_token=eos_text or "") if source else ChatTemplate.plain()
    )
    return HFTokenizer(tokenizer, bos_id, eos_ids, template)
