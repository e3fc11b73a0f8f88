"""CP memory per rank: each CP rank holds about 1/N of a cached prefix's KV bytes on the device and host
tiers (per-rank figures, as /metrics exports them), so at a fixed pool size per rank N times as many
tokens fit; and the gather's scratch is part of the admission budget: with --cp-gather-tokens no
layer's gather ever holds more, and the answers do not change."""

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig, ParallelConfig
from tests.conversations import make_conversations, run_turns

POOL_TOKENS = 1024  # per rank
PAGE = 16
PROMPT = [40 + i % 80 for i in range(PAGE * 20)] + [7]  # 20 full pages and one token


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
        stats = engine._control("gather_stats")
        scratch = {rank: b["scratch"] for rank, b in engine.kv_bytes_by_rank().items()}
        assert engine.flush_cache() and engine.leak_report() == []
    assert got == reference
    for rank, s in stats.items():
        assert 0 < s.most_per_owner <= budget // PAGE, (rank, s)
    # Two buffers of N ranks x the budget's pages of one layer (tiny's bf16/fp32 row of 128 elements).
    assert len(set(scratch.values())) == 1 and next(iter(scratch.values())) in {2 * 2 * budget * 128 * n for n in (2, 4)}
