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
import os
import pathlib
import time
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
from hicache.model.loading.family_config import family_named, model_config, refuse_unsupported, with_decoder_family
from hicache.model.loading.hf_tokenizer import HFTokenizer

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
    return with_decoder_family(loaded)


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
    hint = " (serve its text model: model_type gemma3_text)" if "text_config" in hf_config else ""
    family = family_named(CHECKPOINT_FAMILIES, model_type, f"{root}: model_type", hint)
    refuse_unsupported(family, hf_config, str(root))
    return family


def _config(hf_config: dict[str, Any], family: CheckpointFamily, root: pathlib.Path) -> ModelConfig:
    try:
        max_position = int(hf_config["max_position_embeddings"])
        theta, scaling = _rope(hf_config, max_position, root)
        return model_config(hf_config, family, theta, scaling, str(root))
    except KeyError as exc:
        raise UserError(f"{root}/config.json lacks {exc.args[0]}") from exc
    except (TypeError, ValueError) as exc:
        raise UserError(f"{root}/config.json is invalid: {exc}") from exc


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
