"""The real model with its own early-exit draft (`smollm2-draft`, its first layers; packed, since the
rows match): a two-turn chat, its second turn's history coming back from host memory and, after a
restart, from storage with the draft's pages, equals the cache-off run without a draft, token for
token, with the same acceptance."""

import pytest

from hicache import Engine
from hicache.config import HiCacheConfig, SpeculativeConfig
from tests.conversations import chat_turns

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

SYSTEM = "You answer questions about European geography in one short sentence. " * 10
USERS = ["Alice", "Bob"]
QUESTIONS = ["What is the capital of France?", "Which river flows through it?"]
SPEC = SpeculativeConfig("draft", "smollm2-draft", 2)


def chat(engine: Engine) -> list:
    return chat_turns(engine, SYSTEM, USERS, QUESTIONS, max_new_tokens=12)


def test_smollm2_draft_keeps_the_answers_and_the_acceptance_on_every_tier(tmp_path):
    with Engine(model="smollm2", disable_radix_cache=True) as engine:
        reference = [r.token_ids for r in chat(engine)]
    with Engine(model="smollm2", disable_radix_cache=True, speculative=SPEC) as engine:
        off = chat(engine)
    assert [r.token_ids for r in off] == reference
    # Two histories of ~200 tokens in a 256-token device pool: each turn evicts the other to host memory.
    cfg = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=8.0, hicache_storage_backend="file",
                        hicache_storage_dir=str(tmp_path), hicache_storage_prefetch_threshold=64)  # fmt: skip
    for tier in ("host", "storage"):  # the second engine restarts on the first one's store
        with Engine(model="smollm2", max_total_tokens=256, hicache=cfg, speculative=SPEC) as engine:
            assert engine._runtime.scheduler.cache.lower.host.host.draft_layout == "packed"
            got = chat(engine)
            assert [r.token_ids for r in got] == reference
            assert sum(r.cached_tokens_by_tier[tier] for r in got) > 0, tier
            assert [r.spec_tokens for r in got] == [r.spec_tokens for r in off]
            assert engine.spec_stats().draft_recomputed_tokens == 0
