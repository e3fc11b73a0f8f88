"""Speculative decoding with the model families (tests/model/hf_reference.py's checkpoints, made by
transformers): a Qwen3 target with a Qwen2 draft (another family, the same vocabulary) and a Phi-3 target
with n-gram proposals give the non-speculative cache-off tokens, with a host tier and cache hits. The sliding
families (Gemma) are refused in one line: the hybrid decoder's state is not kept under speculation yet."""

from __future__ import annotations

import pytest

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig, SpeculativeConfig
from hicache.errors import UserError
from tests.model.hf_reference import save_checkpoint
from tests.model.test_model_families import PROMPT

PROMPTS = [PROMPT, PROMPT + [9, 8, 7, 6, 5, 4, 3, 2] * 4]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("target,draft", [("qwen3", "qwen2"), ("phi3", None)], ids=["qwen3-draft-qwen2", "phi3-ngram"])
def test_speculation_on_a_family_keeps_the_cache_off_answer(target, draft, tmp_path):
    save_checkpoint(target, tmp_path / target)
    speculative = SpeculativeConfig("ngram", None, 4)
    if draft is not None:
        save_checkpoint(draft, tmp_path / draft, seed=1, num_hidden_layers=1)
        speculative = SpeculativeConfig("draft", str(tmp_path / draft), 4)
    model = str(tmp_path / target)
    with Engine(model=model, dtype="float32", disable_radix_cache=True) as engine:
        expected = [engine.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    host = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=2.0)
    with Engine(model=model, dtype="float32", hicache=host, speculative=speculative) as engine:
        results = [engine.generate([p], PARAMS)[0] for p in PROMPTS]
    assert [r.token_ids for r in results] == expected
    assert sum(r.cached_tokens for r in results) >= 32


def test_a_sliding_family_refuses_speculation_in_one_line(tmp_path):
    save_checkpoint("gemma3", tmp_path)
    with pytest.raises(UserError, match="not kept with --speculative-algorithm yet"):
        Engine(model=str(tmp_path), dtype="float32", speculative=SpeculativeConfig("ngram", None, 4))
