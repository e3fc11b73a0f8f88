"""CP memory per rank: each CP rank holds about 1/N of a cached prefix's KV bytes on the device and host
tiers (per-rank figures, as /metrics exports them), so at a fixed pool size per rank N times as many
tokens fit, and a request larger than one rank's pool is admitted when its share fits every rank's
(refused, with per-rank figures, when it does not); and the gather's scratch is part of the admission
budget: with --cp-gather-tokens no layer's gather ever holds more, and the answers do not change."""

import pytest
import torch

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig, ParallelConfig
from hicache.errors import RequestTooLargeError
from tests.conversations import make_conversations, run_turns

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

POOL_TOKENS = 1024  # per rank
PAGE = 16
PROMPT = [40 + i % 80 for i in range(PAGE * 20)] + [7]  # 20 full pages and one token
# 1.86x one rank's pool: with 16 new tokens 120 pages, 60 on each CP2 rank, whose pools have 63 each.
LONG_PROMPT = [40 + (i * 7) % 80 for i in range(1900)]
LONG_PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True)


def cached_prefix_bytes(cp: int) -> tuple[dict[str, dict[str, int]], dict[str, tuple[int, int]]]:
    with Engine(
        model="tiny", max_total_tokens=POOL_TOKENS, hicache=HiCacheConfig(enable_hierarchical_cache=True),
        parallel=ParallelConfig(cp_size=cp),
    ) as engine:  # fmt: skip
        engine.generate([PROMPT], None)
        return engine.kv_bytes_by_rank(), engine.pool_usage()


def test_each_cp_rank_holds_half_the_bytes_and_the_pool_twice_the_tokens():
    one_ranks, one_usage = cached_prefix_bytes(1)
    two_ranks, two_usage = cached_prefix_bytes(2)
    (alone,) = one_ranks.values()
    assert alone["device"] > 0 and alone["host"] > 0
    page_bytes = alone["device"] // (one_usage["device"][0] // PAGE)  # one rank's bytes of one page
    assert len(two_ranks) == 2
    for rank, held in two_ranks.items():
        for tier in ("device", "host"):
            assert abs(held[tier] - alone[tier] / 2) <= page_bytes, (rank, tier, held, alone)
    # The same logical pages are cached (the tree is logical), but the CP2 pool, at the same size
    # per rank, has room for twice as many (less one padding page per rank).
    assert two_usage["device"][0] == one_usage["device"][0]
    assert two_usage["device"][1] == 2 * (POOL_TOKENS - PAGE)


@pytest.mark.dtype_sensitive  # a store cap or byte count in the dtype `--dtype auto` takes here
def test_admission_keeps_every_gather_within_the_scratch_budget():
    convs = make_conversations(num_groups=3, per_group=3, system_len=200, question_len=30)
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        reference = [[r.token_ids for r in t] for t in run_turns(engine, convs, 3, 8)]
    budget = 512  # tokens per rank: 32 pages per owner class, half the pool's, about two requests' worth
    with Engine(
        model="tiny", max_total_tokens=POOL_TOKENS, hicache=HiCacheConfig(enable_hierarchical_cache=True),
        parallel=ParallelConfig(cp_size=2, cp_gather_tokens=budget),
    ) as engine:  # fmt: skip
        got = [[r.token_ids for r in t] for t in run_turns(engine, convs, 3, 8)]
        stats = engine.snapshot().gather_by_rank
        scratch = {rank: b["scratch"] for rank, b in engine.kv_bytes_by_rank().items()}
        itemsize = getattr(torch, engine.config.dtype).itemsize  # the dtype --dtype auto took here
        assert engine.flush_cache() and engine.leak_report() == []
    assert got == reference
    for rank, s in stats.items():
        assert 0 < s.most_per_owner <= budget // PAGE, (rank, s)
    # Two buffers of N ranks x the budget's pages of one layer (tiny's row of 128 elements).
    assert set(scratch.values()) == {2 * 2 * budget * 128 * itemsize}, scratch


@pytest.fixture(scope="module")
def cp2_small_pools():
    with Engine(model="tiny", max_total_tokens=POOL_TOKENS, parallel=ParallelConfig(cp_size=2)) as engine:
        yield engine


def test_a_prompt_larger_than_one_ranks_pool_runs_on_two_cp_ranks(cp2_small_pools):
    with Engine(model="tiny", disable_radix_cache=True) as engine:  # one rank, a pool of 32768 tokens
        (reference,) = engine.generate([LONG_PROMPT], LONG_PARAMS)
    (got,) = cp2_small_pools.generate([LONG_PROMPT], LONG_PARAMS)
    assert got.error is None and got.finish_reason == "length"
    assert got.token_ids == reference.token_ids
    assert cp2_small_pools.flush_cache() and cp2_small_pools.leak_report() == []


def test_a_request_too_large_for_every_cp_rank_is_refused_with_per_rank_figures(cp2_small_pools):
    too_long = LONG_PROMPT + LONG_PROMPT[:200]  # 2116 tokens with the new ones: 133 pages, 67 on a rank
    expected = (
        "prompt (2100 tokens) plus max new tokens (16) needs up to 67 KV pages on each of the 2 CP ranks "
        "(133 in all) but each rank's pool has 63 (raise --max-total-tokens)"
    )
    with pytest.raises(RequestTooLargeError) as refused:
        cp2_small_pools.submit(too_long, LONG_PARAMS)
    assert str(refused.value) == expected
    # The engine still serves after refusing.
    assert cp2_small_pools.generate([PROMPT], LONG_PARAMS)[0].finish_reason == "length"
