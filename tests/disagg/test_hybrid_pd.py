"""`tiny-hybrid` through a P/D pair with decode reuse (docs/DESIGN.md, "hybrid models"): a page's rows carry
the recurrent-state snapshot and the sliding-window KV, so prefill sends only the suffix after
`decode_prefix_len` and decode restores the rest from its own cache; greedy tokens equal one cache-off
engine's, turn after turn."""

from __future__ import annotations

import random

import pytest

from hicache import Engine, SamplingParams
from hicache.config import DisaggConfig, EngineConfig, HiCacheConfig
from tests.disagg.pd import PDPair, free_ports

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PAGE = 16
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
QUESTION = 30
# Pools as large as the defaults, then sliding-window pools of 16 pages, where two requests' windows do not
# fit together and the cached windows are evicted (docs/DESIGN.md, "Hybrid models").
SMALL = {"max_total_tokens": 1024, "swa_full_tokens_ratio": 0.25}


@pytest.mark.parametrize("pools", [{}, SMALL], ids=["wide", "small"])
def test_a_hybrid_through_a_pd_pair_with_decode_reuse_equals_cache_off(pools):
    port = free_ports(1)
    sends = DisaggConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
    prefill = Engine(EngineConfig(model="tiny-hybrid", disagg=sends, **pools))
    decode = Engine(EngineConfig(
        model="tiny-hybrid", **pools,
        hicache=HiCacheConfig(enable_hierarchical_cache=True, hicache_load_back_threshold=16),
        disagg=DisaggConfig(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True),
    ))  # fmt: skip
    reference = Engine(EngineConfig(model="tiny-hybrid", disable_radix_cache=True))
    try:
        pair, rng = PDPair(prefill, decode, port), random.Random(1)
        histories = [[rng.randrange(32, 127) for _ in range(150)] for _ in range(2)]
        for turn in range(2):
            turns, expected = pair.run(histories, PARAMS), reference.generate(histories, PARAMS)
            for prompt, got, want in zip(histories, turns, expected):
                assert got.decode.error is None, got.decode.error
                assert got.decode.token_ids == want.token_ids, f"turn {turn}: tokens differ from the cache-off engine"
                reused = got.decode_prefix_tokens
                assert reused % PAGE == 0 and got.transferred_tokens == len(prompt) - reused
                if turn:
                    assert reused >= len(prompt) - QUESTION - PAGE - PARAMS.max_new_tokens, "decode reuses the history"
            for history, got in zip(histories, turns):
                history.extend(got.decode.token_ids)
                history.extend(rng.randrange(32, 127) for _ in range(QUESTION))
        # Host copies are of whole rows: pages whose window KV decode dropped on arrival are not copied.
        assert decode.cache_stats().workers.transfer_failures == 0
    finally:
        for engine in (prefill, decode, reference):
            engine.shutdown()
