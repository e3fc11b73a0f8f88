"""The real model through every tier: a multi-turn chat whose working set is several times the device
pool, served from device, host and (after a restart) storage, equals the cache-off run token for token."""

import pytest

from hicache import Engine
from hicache.config import HiCacheConfig
from tests.conversations import chat_turns

SYSTEM = "You answer questions about European geography in one short sentence. " * 36
USERS = ["Alice", "Bob", "Carol"]
QUESTIONS = ["What is the capital of France?", "And of Spain?", "Which river flows through it?"]


def chat(engine: Engine) -> list[tuple[list[int], dict]]:
    """Three users' conversations, interleaved turn by turn, each turn carrying its whole history."""
    return [(r.token_ids, r.cached_tokens_by_tier) for r in chat_turns(engine, SYSTEM, USERS, QUESTIONS, 24)]


@pytest.fixture(scope="module")
def reference():
    with Engine(model="smollm2", disable_radix_cache=True) as engine:
        return [t for t, _ in chat(engine)]


# The real model under the default policy; the others (write-back, and selective: backed up from a
# node's second hit) run on tiny (tests/cache/test_hicache.py): a policy decides when pages move, which
# is the same code whatever the model.
def test_smollm2_tiers_equal_cache_off(reference, tmp_path):
    cfg = HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_write_policy="write_through",
        hicache_ratio=4.0,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_storage_prefetch_threshold=64,
    )
    # ~1,000 tokens of device pool for three ~300-400 token conversations: every turn evicts.
    flags = dict(model="smollm2", max_total_tokens=1024, page_size=16, hicache=cfg)
    with Engine(**flags) as engine:
        turns = chat(engine)
        assert [t for t, _ in turns] == reference
        assert sum(tiers["host"] for _, tiers in turns) > 0
        assert engine.flush_cache() and engine.leak_report() == []
    with Engine(**flags) as engine:  # a restart: only storage remains
        turns = chat(engine)
        assert [t for t, _ in turns] == reference
        assert sum(tiers["storage"] for _, tiers in turns) > 0
        assert engine.flush_cache() and engine.leak_report() == []
