"""`tiny-hybrid` through the prefix cache (docs/DESIGN.md, "hybrid models"): multi-turn conversations served
from the device tier, from host memory and from file storage after a restart equal the cache-off run token
for token; a cache that keeps a prefix's KV but not its recurrent-state snapshots changes the answers (so
these tests can fail); where its state is not kept yet the model is refused at start-up, naming the flag."""

from __future__ import annotations

import pytest

from hicache import Engine
from hicache.config import HiCacheConfig, ParallelConfig
from hicache.errors import UserError
from hicache.model.families.hybrid import LINEAR, LINEAR_STATE
from tests.conversations import make_conversations, run_turns

CONVS = make_conversations(num_groups=2, per_group=2, system_len=160, question_len=24)
TURNS = 3
NEW = 12


def tokens(turns):
    return [[r.token_ids for r in results] for results in turns]


def hits_by_tier(turns) -> dict[str, int]:
    totals: dict[str, int] = {}
    for results in turns:
        for r in results:
            for tier, n in r.cached_tokens_by_tier.items():
                totals[tier] = totals.get(tier, 0) + n
    return totals


@pytest.fixture(scope="module")
def reference():
    with Engine(model="tiny-hybrid", disable_radix_cache=True) as engine:
        return tokens(run_turns(engine, CONVS, TURNS, NEW))


@pytest.mark.slow
def test_device_tier_equals_cache_off_and_not_without_the_state_snapshots(reference):
    """Then the negative control: every cached page loses its recurrent-state snapshots (its KV stays), as
    in a cache that kept only attention's KV; the first turn asked again hits those pages, and its answers
    change."""
    with Engine(model="tiny-hybrid") as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        assert hits_by_tier(turns).get("device", 0) > 0, hits_by_tier(turns)
        runner = engine._runtime.scheduler.runner
        engine._runtime.call(lambda: drop_state_snapshots(runner.model, runner.pool))
        again = run_turns(engine, CONVS, 1, NEW)
        assert hits_by_tier(again).get("device", 0) > 0
        assert tokens(again)[0] != reference[0]


def drop_state_snapshots(model, pool) -> None:
    """Zero the snapshot columns of the linear-attention layers' rows (attention layers use those columns
    for K and V)."""
    offset, numel = model.linear_layout.span(LINEAR_STATE)
    for layer, kind in enumerate(model.layer_types):
        if kind == LINEAR:
            pool.buffers[layer][:, offset : offset + numel] = 0


@pytest.mark.slow
def test_host_memory_then_file_storage_after_a_restart_equal_cache_off(reference, tmp_path):
    store = HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "store"),
        hicache_storage_prefetch_threshold=64,
    )
    # A 512-token device pool under four conversations: their histories come back from host memory.
    with Engine(model="tiny-hybrid", max_total_tokens=512, hicache=store) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        assert hits_by_tier(turns).get("host", 0) > 0, hits_by_tier(turns)
        assert engine.cache_stats().storage.store.puts > 0
        assert engine.flush_cache() and engine.leak_report() == []
    # A new server on the same store: nothing in memory, storage serves the prefixes with their snapshots.
    with Engine(model="tiny-hybrid", max_total_tokens=512, hicache=store) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        assert hits_by_tier(turns).get("storage", 0) > 0, hits_by_tier(turns)
        assert engine.cache_stats().storage.store.corrupt == 0


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"parallel": ParallelConfig(tp_size=2)}, "--tp-size > 1"),
        ({"parallel": ParallelConfig(cp_size=2)}, "--cp-size > 1"),
        ({"hicache": HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="file",
                                   hicache_storage_key_scheme="unified")}, "--hicache-storage-key-scheme unified"),
        ({"page_size": 8}, "--page-size must be at least 16"),
    ],
)  # fmt: skip
def test_what_is_not_built_for_a_hybrid_is_refused_at_start_up(overrides, named):
    with pytest.raises(UserError, match=named.replace("+", r"\+")):
        Engine(model="tiny-hybrid", **overrides)
