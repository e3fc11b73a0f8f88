"""Each CP rank holds about 1/N of a cached prefix's KV bytes on the device and host tiers (per-rank
figures, as /metrics exports them), so at a fixed pool size per rank N times as many tokens fit."""

from hicache import Engine
from hicache.config import HiCacheConfig, ParallelConfig

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
