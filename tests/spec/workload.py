"""The speculative tests' workload: 4 conversations of 3 turns whose working set is ~3x the device pool
(later turns come back from host memory), the draft configuration, and what the tests read of a run."""

from __future__ import annotations

from hicache import Engine
from hicache.cache.stats import PrefetchLoss
from hicache.config import HiCacheConfig, SpeculativeConfig
from tests.conversations import make_conversations, run_turns
from tests.parallel.workload import tier_totals, tokens

CONVS = make_conversations(num_groups=2, per_group=2, system_len=200, question_len=30)
TURNS = 3
NEW = 16
DEVICE_TOKENS = 512  # the working set is ~3x this: later turns come back from host memory
K = 4


def acceptance(turns) -> tuple[int, int]:
    """(proposed, accepted) draft tokens over every request, as generate reports them."""
    pairs = [r.spec_tokens for results in turns for r in results]
    assert all(p is not None for p in pairs)
    return sum(p for p, _ in pairs), sum(a for _, a in pairs)


def spec(draft: str) -> SpeculativeConfig:
    return SpeculativeConfig("draft", draft, K)


def tiers(tmp_path, **kw) -> HiCacheConfig:
    store = str(tmp_path / "store")
    return HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_storage_backend="file",
                         hicache_storage_dir=store, hicache_storage_prefetch_threshold=16, **kw)  # fmt: skip


def every_tier_then_storage(cfg: HiCacheConfig, draft: str, layout: str, reference, cache_off) -> None:
    """The workload speculated with `draft` on the tiers `cfg` configures: device and host hits, then, on a new
    engine over the same store, storage hits; each run gives the cache-off tokens and acceptance, restores
    the draft with every hit (nothing recomputed) and leaks nothing. `layout`: the draft's host layout."""
    for tier in ("host", "storage"):  # the second engine restarts on the first one's store
        with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, speculative=spec(draft)) as engine:
            assert engine._runtime.scheduler.cache.lower.host.host.draft_layout == layout
            turns = run_turns(engine, CONVS, TURNS, NEW)
            assert tokens(turns) == reference
            served = tier_totals(turns)
            assert served[tier] > 0 and (tier == "storage" or served["device"] > 0), served
            assert acceptance(turns) == cache_off[draft]
            stats = engine.cache_stats().storage
            assert stats.prefetch.lost[PrefetchLoss.DRAFT_MISSING] == 0 and stats.store.corrupt == 0
            assert engine.spec_stats().draft_recomputed_tokens == 0  # every hit restored the draft too
            assert_clean(engine)


def assert_clean(engine: Engine) -> None:
    assert engine.flush_cache()
    assert engine.leak_report() == []
