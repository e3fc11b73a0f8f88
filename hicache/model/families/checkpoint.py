"""What a checkpoint family is to the loaders: how its config.json says which layer parts its decoder
is built from (hicache/model/config.py, LayerParts), and how its weights map onto the decoder's names
(Hugging Face Llama's, with the parts' extra tensors under their Hugging Face names). Each family is a
`CheckpointFamily` in its own module (llama.py, qwen.py, phi3.py, gemma.py); `CHECKPOINT_FAMILIES` in
registry.py says which `model_type` is which. Every family's decoder is the same Llama decoder (or, where
some layers slide, the hybrid one): the parts, not a subclass, say how its layers differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache.model.config import LayerParts

HFConfig = dict[str, Any]  # a parsed config.json


def _llama_parts(hf_config: HFConfig) -> LayerParts:
    return LayerParts()


def _same_names(weights: dict[str, Any], hf_config: HFConfig) -> dict[str, Any]:
    return weights


def _accepted(hf_config: HFConfig) -> str | None:
    return None


def _listed_layer_types(hf_config: HFConfig) -> tuple[str, ...]:
    return tuple(hf_config.get("layer_types") or ())


@dataclass(frozen=True)
class CheckpointFamily:
    """`parts`: the LayerParts its config implies. `weights`: its tensors (float32, as stored) under the
    decoder's names. `refusal`: why the decoder cannot compute this config (one line), or None.
    `layer_types`: each layer's attention kind (hybrid.FULL / SLIDING), where old configs leave it implied.

    From a GGUF (hicache/model/loading/gguf_loader.py): `gguf_arch` is llama.cpp's name of the architecture;
    the file's metadata is read into config.json's keys, plus `gguf_config`'s, which llama.cpp infers rather
    than stores; `gguf_names` renames llama.cpp's layer tensors where the family's differ from Llama's
    (phi3's fused ones, Gemma's norms); `gguf_weights` is `weights` for tensors llama.cpp's converter wrote
    (it already shifted Gemma's norms by one, for one)."""

    name: str
    parts: Callable[[HFConfig], LayerParts] = _llama_parts
    weights: Callable[[dict[str, Any], HFConfig], dict[str, Any]] = _same_names
    refusal: Callable[[HFConfig], str | None] = _accepted
    layer_types: Callable[[HFConfig], tuple[str, ...]] = _listed_layer_types
    gguf_arch: str | None = None
    gguf_config: Callable[[HFConfig], HFConfig] = lambda hf_config: {}
    gguf_names: tuple[tuple[str, str], ...] = ()
    gguf_weights: Callable[[dict[str, Any], HFConfig], dict[str, Any]] = _same_names
