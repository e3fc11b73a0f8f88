"""The decoder families by name (docs/DESIGN.md, "model family"): the one place that says which decoder
class a LoadedModel is built as (hicache/model/build.py) and which config type that decoder reads.

A loader names its model's family in `LoadedModel.family`: the GGUF and Hugging Face loaders and `tiny`
load Llamas (the default), `tiny-mla` an MLA decoder, the sidecar draft (hicache/model/loading/draft.py)
a token-shift decoder, `tiny-mtp` an MTP head, `tiny-hybrid` a hybrid decoder (hybrid.py). Another family
plugs in with its config type, a decoder implementing `DecoderModel` (hicache/model/base.py) and one entry
here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.families import hybrid, llama, mla, mtp, shift


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
