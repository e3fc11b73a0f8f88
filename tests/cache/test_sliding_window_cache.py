"""`tiny-hybrid`'s sliding-window KV in the prefix cache (docs/DESIGN.md, "Hybrid models"): the sliding layers'
pages outside the window are freed and evicted on their own, and the answers stay the cache-off run's;
a hit whose window KV was freed shrinks to where it is held; nothing is left allocated after a flush."""

from __future__ import annotations

import random

import pytest

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig
from hicache.errors import UserError
from tests.cache.test_hybrid_cache import hits_by_tier, tokens
from tests.conversations import make_conversations, run_turns

# Histories of 160 + 4 x (24 + 12) = 304 tokens: almost five 64-token windows.
CONVS = make_conversations(num_groups=2, per_group=2, system_len=160, question_len=24, seed=3)
TURNS = 4
NEW = 12
# 64 pages, 32 of them for the sliding layers: four running histories need 76 sliding pages, so requests
# wait on the sliding pool and the cached windows are evicted from it.
SMALL = {"max_total_tokens": 1024, "swa_full_tokens_ratio": 0.5}


@pytest.fixture(scope="module")
def reference():
    with Engine(model="tiny-hybrid", disable_radix_cache=True) as engine:
        return tokens(run_turns(engine, CONVS, TURNS, NEW))


def sliding_tier(engine: Engine):
    return engine.call_in_loop(lambda: engine._runtime.scheduler.cache.device.sliding)


@pytest.mark.slow
@pytest.mark.parametrize("hierarchical", [False, True], ids=["device", "host"])
def test_conversations_longer_than_windows_under_sliding_eviction_equal_cache_off(reference, hierarchical,
                                                                                   tmp_path):  # fmt: skip
    """The device tier alone frees each finished request's pages outside its window; with host memory and
    file storage below it, the window KV of backed-up nodes goes under pressure (host copies and stored
    pages keep whole rows), and a new server on the same store answers alike from storage."""
    host = HiCacheConfig(
        enable_hierarchical_cache=hierarchical, hicache_ratio=4.0,
        hicache_storage_backend="file" if hierarchical else None,
        hicache_storage_dir=str(tmp_path / "store") if hierarchical else None,
        hicache_storage_prefetch_threshold=64,
    )  # fmt: skip
    with Engine(model="tiny-hybrid", hicache=host, **SMALL) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        hits = hits_by_tier(turns)
        assert hits.get("device", 0) + hits.get("host", 0) > 0, hits
        sliding = sliding_tier(engine)
        assert sliding.evicted > 0, "the sliding pool never ran short: the test exercised no eviction"
        if not hierarchical:
            assert sliding.freed_at_release > 0
        # Before the flush the tree holds window KV, and the leak report sees it (so it can fail).
        assert any("sliding-window pages" in p for p in engine.leak_report()), engine.leak_report()
        assert engine.flush_cache()
        assert engine.leak_report() == []
        assert sliding.pages.used_pages == 0
    if hierarchical:
        with Engine(model="tiny-hybrid", hicache=host, **SMALL) as engine:
            turns = run_turns(engine, CONVS, TURNS, NEW)
            assert tokens(turns) == reference
            assert hits_by_tier(turns).get("storage", 0) > 0, hits_by_tier(turns)


def test_a_hit_shrinks_to_where_the_window_kv_is_held():
    """P (8 pages) is cached with its last window held; A = P + 272 tokens reuses P and, once it ends, frees
    its own pages' window KV but the last window's. B, sharing A's first 12 pages, would hit 12; the window
    before page 12 was freed, so the hit shrinks to P's 8 pages, where it is held, and `lookup` says so first."""
    rng = random.Random(7)
    p = [rng.randrange(32, 127) for _ in range(128)]
    a = p + [rng.randrange(32, 127) for _ in range(272)]
    b = a[:200] + [rng.randrange(32, 127) for _ in range(100)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with Engine(model="tiny-hybrid", disable_radix_cache=True) as engine:
        expected = [engine.generate([prompt], params)[0].token_ids for prompt in (p, a, b)]
    with Engine(model="tiny-hybrid") as engine:
        results = [engine.generate([prompt], params)[0] for prompt in (p, a)]
        cache = engine._runtime.scheduler.cache
        looked = engine.call_in_loop(lambda: cache.lookup(b, ""))  # arrival's look sees the shrunk hit too
        results.append(engine.generate([b], params)[0])
        assert looked.device == 128
        assert [r.token_ids for r in results] == expected
        assert [r.cached_tokens_by_tier.get("device", 0) for r in results] == [0, 128, 128]
        sliding = sliding_tier(engine)
        assert (sliding.shrunk_hits, sliding.shrunk_pages) == (1, 4)


def test_the_sliding_pool_ratio_is_refused_where_it_cannot_apply():
    with pytest.raises(UserError, match="has none"):
        Engine(model="tiny", swa_full_tokens_ratio=0.5)
    with pytest.raises(UserError, match=r"must be in \(0, 1\]"):
        Engine(model="tiny-hybrid", swa_full_tokens_ratio=0)
