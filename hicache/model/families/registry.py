"""The decoder families by name (docs/DESIGN.md, "model family"): the one place that says which decoder
class a LoadedModel is built as (hicache/model/build.py) and which config type that decoder reads.

A loader names its model's family in `LoadedModel.family`: the GGUF and Hugging Face loaders and `tiny`
load Llamas (the default), `tiny-mla` an MLA decoder, the sidecar draft (hicache/model/loading/draft.py)
a token-shift decoder, `tiny-mtp` an MTP head, `tiny-hybrid` a hybrid decoder (hybrid.py). Another family
plugs in with its config type, a decoder implementing `DecoderModel` (hicache/model/base.py) and one entry
here. A checkpoint family (Qwen, Phi-3, Gemma: which layer parts, which weight names) is one entry of
`CHECKPOINT_FAMILIES` and its module.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.families import gemma, hybrid, llama, mla, mtp, phi3, qwen, shift
from hicache.model.families.checkpoint import CheckpointFamily


@dataclass(frozen=True)
class Family:
    config: type[ModelConfig]  # what the family's loaders fill: the decoder reads its fields
    decoder: type[llama.LlamaModel]  # decoder(config, weights, pctx, dtype, device, make_linear, sharding)


FAMILIES: dict[str, Family] = {
    llama.FAMILY: Family(ModelConfig, llama.LlamaModel),
    mla.FAMILY: Family(mla.MLAConfig, mla.MLAModel),
    shift.FAMILY: Family(ModelConfig, shift.TokenShiftModel),
    mtp.FAMILY: Family(ModelConfig, mtp.MTPHeadModel),
    hybrid.FAMILY: Family(hybrid.HybridConfig, hybrid.HybridModel),
}


# Hugging Face `model_type` -> how its checkpoints map onto the decoders above (families/checkpoint.py).
CHECKPOINT_FAMILIES: dict[str, CheckpointFamily] = {
    "llama": llama.LLAMA,
    "mistral": llama.LLAMA,
    "qwen2": qwen.QWEN2,
    "qwen3": qwen.QWEN3,
    "phi3": phi3.PHI3,
    "gemma2": gemma.GEMMA2,
    "gemma3_text": gemma.GEMMA3,
}

# llama.cpp's `general.architecture` -> the same families, for GGUF files.
GGUF_FAMILIES: dict[str, CheckpointFamily] = {
    family.gguf_arch: family for family in CHECKPOINT_FAMILIES.values() if family.gguf_arch is not None
}


def family_of(loaded: LoadedModel) -> Family:
    """`loaded`'s family. A config of another type is refused here rather than deep in the forward pass:
    a decoder given another family's config reads fields it lacks or ignores ones it needs."""
    family = FAMILIES[loaded.family]
    if type(loaded.config) is not family.config:
        raise ValueError(
            f"model {loaded.name!r}: the {loaded.family} family takes a {family.config.__name__}, "
            f"not a {type(loaded.config).__name__}"
        )
    return family
