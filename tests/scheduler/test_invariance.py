"""The invariant: a cache never changes an answer. Greedy outputs with the radix cache on equal the
outputs with it off, token for token, even when pool pressure forces eviction mid-conversation."""

import pytest

from hicache import Engine
from tests.conversations import make_conversations, run_turns


def _tokens(turns):
    return [[r.token_ids for r in results] for results in turns]


@pytest.fixture(scope="module")
def reference():
    convs = make_conversations(num_groups=2, per_group=3, system_len=300, question_len=40)
    with Engine(model="tiny", disable_radix_cache=True, max_total_tokens=8192) as engine:
        turns = run_turns(engine, convs, turns=4, max_new_tokens=24)
        assert all(r.cached_tokens == 0 for results in turns for r in results)
    return convs, _tokens(turns)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        dict(max_total_tokens=8192),  # everything fits
        dict(max_total_tokens=1024, page_size=16),  # working set ~3x the pool: eviction every turn
        dict(max_total_tokens=1024, page_size=64, chunked_prefill_size=96),  # large pages, chunked prefill
        dict(max_total_tokens=2048, page_size=1, max_running_requests=2),  # token pages, queueing
    ],
    ids=["roomy", "pressure", "chunked", "page1-queued"],
)
def test_cache_on_equals_cache_off(reference, flags):
    convs, expected = reference
    with Engine(model="tiny", **flags) as engine:
        turns = run_turns(engine, convs, turns=4, max_new_tokens=24)
        assert _tokens(turns) == expected
        later = [r.cached_tokens for results in turns[1:] for r in results]
        assert sum(c > 0 for c in later) >= len(later) // 2, f"later turns must mostly hit the cache: {later}"
        for results in turns:
            for r in results:
                assert r.cached_tokens_by_tier["host"] == r.cached_tokens_by_tier["storage"] == 0
                assert r.cached_tokens % engine.config.page_size == 0
        assert engine.flush_cache()
        assert engine.leak_report() == []


def test_flush_during_a_request_leaks_nothing():
    with Engine(model="tiny", max_total_tokens=2048) as engine:
        handle = engine.submit(list(range(32, 100)), None)
        # Whether the flush lands before or after the request ends, nothing may leak.
        engine.flush_cache()
        handle.result()
        assert engine.flush_cache()
        assert engine.leak_report() == []
