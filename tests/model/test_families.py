"""The family registry (hicache/model/families/registry.py): every built-in model and draft names the
decoder it is built as, and a config of another family's type is refused before any decoder is built."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hicache.model.families.hybrid import HybridModel
from hicache.model.families.llama import LlamaModel
from hicache.model.families.mla import MLAModel
from hicache.model.families.mtp import MTPHeadModel
from hicache.model.families.registry import family_of
from hicache.model.families.shift import TokenShiftModel
from hicache.model.families.tiny_mla import TINY_MLA_CONFIG
from hicache.model.loading.draft import load_draft
from hicache.model.loading.loader import load_model


def test_each_builtin_model_and_draft_is_built_as_its_family():
    tiny = load_model("tiny")
    assert family_of(tiny).decoder is LlamaModel
    assert family_of(load_model("tiny-mla")).decoder is MLAModel
    assert family_of(load_model("tiny-hybrid")).decoder is HybridModel
    assert family_of(load_draft("tiny-draft-packed", tiny)).decoder is LlamaModel
    assert family_of(load_draft("tiny-draft-sidecar", tiny)).decoder is TokenShiftModel
    assert family_of(load_draft("tiny-mtp", tiny)).decoder is MTPHeadModel


def test_a_config_of_another_family_is_refused():
    with pytest.raises(ValueError, match="the llama family takes a ModelConfig, not a MLAConfig"):
        family_of(replace(load_model("tiny"), config=TINY_MLA_CONFIG))
