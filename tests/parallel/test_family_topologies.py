"""The model families on the topologies (tests/model/hf_reference.py's checkpoints, made by transformers):
Qwen2's biases split over TP2 with the projections' groups, Qwen3's QK-norm on PP2's stages, Phi-3 with its
pages sharded over CP2; each with the host and file tiers answers a prompt, a repeat and an extension token
for token as the single-rank cache-off run, from its cache, and holds nothing after a flush. The sliding
families (Gemma) run on one rank (the hybrid decoder's refusal, one line)."""

from __future__ import annotations

import pytest

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig, ParallelConfig
from hicache.errors import UserError
from tests.model.hf_reference import save_checkpoint
from tests.model.test_model_families import PROMPT

PROMPTS = [PROMPT, PROMPT, PROMPT + [9, 8, 7, 6, 5, 4, 3, 2] * 4]
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


def tokens(engine: Engine) -> tuple[list[list[int]], int]:
    results = [engine.generate([prompt], PARAMS)[0] for prompt in PROMPTS]
    return [r.token_ids for r in results], sum(r.cached_tokens for r in results)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "family,topology",
    [("qwen2", {"tp_size": 2}), ("qwen3", {"pp_size": 2}), ("phi3", {"cp_size": 2})],
    ids=["qwen2-tp2", "qwen3-pp2", "phi3-cp2"],
)
def test_a_family_on_a_topology_with_tiers_equals_single_rank_cache_off(family, topology, tmp_path):
    save_checkpoint(family, tmp_path / "model")
    model = str(tmp_path / "model")
    with Engine(model=model, dtype="float32", disable_radix_cache=True) as engine:
        reference, _ = tokens(engine)
    tiers = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_storage_backend="file",
                          hicache_storage_dir=str(tmp_path / "store"))  # fmt: skip
    with Engine(model=model, dtype="float32", page_size=16, hicache=tiers,
                parallel=ParallelConfig(**topology)) as engine:  # fmt: skip
        answers, cached = tokens(engine)
        assert answers == reference
        assert cached >= 2 * 32, cached  # the repeat and the extension hit the prompt's whole pages
        assert engine.flush_cache()
        assert engine.leak_report() == []


def test_a_sliding_family_refuses_tp2_in_one_line(tmp_path):
    save_checkpoint("gemma3", tmp_path)
    with pytest.raises(UserError, match="tp-size"):
        Engine(model=str(tmp_path), dtype="float32", parallel=ParallelConfig(tp_size=2))
