"""The model families through a P/D pair with decode reuse (tests/model/hf_reference.py's checkpoints, made
by transformers): Qwen2 (biases) and Gemma 3 (sliding-window layers, the hybrid decoder's rows) greedy tokens
equal one cache-off engine's over two turns, the second turn's history reused on the decode side."""

from __future__ import annotations

import random

import pytest

from hicache import Engine, SamplingParams
from hicache.config import DisaggConfig, EngineConfig, HiCacheConfig
from tests.disagg.pd import PDPair, free_ports
from tests.model.hf_reference import save_checkpoint

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PAGE = 16
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
QUESTION = 20


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_family_through_a_pd_pair_with_decode_reuse_equals_cache_off(family, tmp_path):
    save_checkpoint(family, tmp_path)
    model, port = str(tmp_path), free_ports(1)
    sends = DisaggConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
    prefill = Engine(EngineConfig(model=model, dtype="float32", disagg=sends))
    decode = Engine(EngineConfig(
        model=model, dtype="float32",
        hicache=HiCacheConfig(enable_hierarchical_cache=True, hicache_load_back_threshold=16),
        disagg=DisaggConfig(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True),
    ))  # fmt: skip
    reference = Engine(EngineConfig(model=model, dtype="float32", disable_radix_cache=True))
    try:
        pair, rng = PDPair(prefill, decode, port), random.Random(2)
        histories = [[rng.randrange(5, 290) for _ in range(70)] for _ in range(2)]
        for turn in range(2):
            turns, expected = pair.run(histories, PARAMS), reference.generate(histories, PARAMS)
            for got, want in zip(turns, expected):
                assert got.decode.error is None, got.decode.error
                assert got.decode.token_ids == want.token_ids, f"turn {turn}: tokens differ from the cache-off engine"
                if turn:
                    assert got.decode_prefix_tokens >= PAGE, "decode reuses the history"
            for history, got in zip(histories, turns):
                history.extend(got.decode.token_ids)
                history.extend(rng.randrange(5, 290) for _ in range(QUESTION))
    finally:
        for engine in (prefill, decode, reference):
            engine.shutdown()
