"""Benchmark metrics: the prefix index against brute force, the ideal hit rate on a hand-checked
example, and a summary whose numbers are recomputed here from its records."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.bench.metrics import IdealCache, PrefixIndex, RequestRecord, hit_rates, summarize


def brute_force(held: list[list[int]], query: list[int]) -> int:
    best = 0
    for seq in held:
        n = 0
        while n < min(len(seq), len(query)) and seq[n] == query[n]:
            n += 1
        best = max(best, n)
    return best


sequences = st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=12)


@settings(max_examples=200, deadline=None)
@given(inserted=sequences, queries=sequences)
def test_prefix_index_matches_brute_force(inserted: list[list[int]], queries: list[list[int]]) -> None:
    index = PrefixIndex()
    for i, seq in enumerate(inserted):
        index.insert(seq)
        for query in queries + inserted[: i + 1]:
            assert index.longest_prefix(query) == brute_force(inserted[: i + 1], query)


@settings(max_examples=100, deadline=None)
@given(prompts=sequences, seed=st.randoms())
def test_total_reusable_prompt_tokens_do_not_depend_on_order(prompts: list[list[int]], seed) -> None:
    def total(order: list[list[int]]) -> int:
        cache = IdealCache()
        return sum(cache.on_send(p) for p in order)

    shuffled = list(prompts)
    seed.shuffle(shuffled)
    assert total(prompts) == total(shuffled)


def test_ideal_hit_rate_hand_checked_example() -> None:
    cache = IdealCache()
    # A is sent: nothing is held yet.
    assert cache.on_send([1, 2, 3, 4]) == 0
    # B is sent while A runs: A's prompt is held from the moment it was sent (3 shared tokens).
    assert cache.on_send([1, 2, 3, 9]) == 3
    # A's answer [5, 6] arrives: A's prompt + answer is held.
    cache.on_finish([1, 2, 3, 4], [5, 6])
    # C shares A's prompt and the first answer token: 5.
    assert cache.on_send([1, 2, 3, 4, 5, 7]) == 5
    # D is A's next turn: the whole of A's prompt + answer (6), then new tokens.
    assert cache.on_send([1, 2, 3, 4, 5, 6, 8, 8]) == 6
    # E shares nothing.
    assert cache.on_send([7]) == 0
    # B's answer: B's prompt + [4] is [1, 2, 3, 9, 4]; F matches all of it and one token of nothing else.
    cache.on_finish([1, 2, 3, 9], [4])
    assert cache.on_send([1, 2, 3, 9, 4, 4]) == 5
    # A flush empties the infinite cache too.
    cache.clear()
    assert cache.on_send([1, 2, 3, 4]) == 0
    # Ideal hit rate of A..F: (0 + 3 + 5 + 6 + 0 + 5) / (4 + 4 + 6 + 8 + 1 + 6) = 19 / 29.
    records = [
        RequestRecord("arm", 0, 0, 1, 0.0, prompt_tokens=p, prompt_tokens_client=p, ideal_cached_tokens=i)
        for p, i in zip([4, 4, 6, 8, 1, 6], [0, 3, 5, 6, 0, 5])
    ]
    assert hit_rates(records)["ideal_hit_rate"] == pytest.approx(19 / 29)


def test_prefix_index_is_fast_for_long_multi_turn_histories() -> None:
    """32 conversations x 20 turns of growing 1000-token steps: 640 requests, up to 20k tokens each."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50000, 2000)
    cache = IdealCache()
    histories = [system.copy() for _ in range(32)]
    for turn in range(20):
        for c in range(32):
            # What an earlier request computed: the shared system prompt, or this conversation so far.
            expected = len(histories[c]) if turn or c else 0
            histories[c] = np.concatenate([histories[c], rng.integers(0, 50000, 1000)])
            assert cache.on_send(histories[c]) == expected
            answer = rng.integers(0, 50000, 200)
            cache.on_finish(histories[c], answer)
            histories[c] = np.concatenate([histories[c], answer])


def record(rnd: int, ttft: float, prompt: int, cached: int, ideal: int, tiers: bool = True, **kw) -> RequestRecord:
    by_tier = {"device": cached - 1, "host": 1, "storage": 0} if tiers else None
    return RequestRecord(
        "arm",
        0,
        0,
        rnd,
        0.0,
        prompt_tokens=prompt,
        prompt_tokens_client=prompt,
        output_tokens=5,
        cached_tokens=cached,
        cached_tokens_by_tier=by_tier,
        ideal_cached_tokens=ideal,
        ttft_s=ttft,
        latency_s=ttft + 0.4,
        itl_s=[0.1, 0.1, 0.1, 0.1],
        **kw,
    )


def test_summary_agrees_with_its_records() -> None:
    records = [
        record(1, 0.5, 100, 10, 40),
        record(1, 0.3, 100, 20, 40),
        record(2, 0.1, 200, 150, 180),
        record(2, 9.9, 300, 0, 0, error="HTTP 500: boom"),  # failed: in no metric
    ]
    s = summarize("arm", records, duration_s=2.0, extra={"dataset": "x"})
    assert s["type"] == "summary" and s["arm"] == "arm" and s["dataset"] == "x"
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 400 and s["total_output_tokens"] == 15
    assert s["input_throughput"] == pytest.approx(200) and s["request_throughput"] == pytest.approx(1.5)
    assert s["ttft_mean_s"] == pytest.approx(0.3) and s["ttft_median_s"] == pytest.approx(0.3)
    assert s["ttft_p99_s"] == pytest.approx(np.percentile([0.1, 0.3, 0.5], 99))
    assert s["tpot_mean_s"] == pytest.approx(0.1) and s["itl_median_s"] == pytest.approx(0.1)
    assert s["e2e_latency_mean_s"] == pytest.approx(0.7)
    assert s["hit_rate"] == pytest.approx(180 / 400) and s["ideal_hit_rate"] == pytest.approx(260 / 400)
    assert s["hit_rate_by_tier"] == pytest.approx({"device": 177 / 400, "host": 3 / 400, "storage": 0.0})
    assert s["tiers_reported"] is True
    round1, round2 = s["per_round"]
    assert round1["round"] == 1 and round1["requests"] == 2
    assert round1["hit_rate"] == pytest.approx(30 / 200) and round1["ideal_hit_rate"] == pytest.approx(80 / 200)
    assert round1["ttft_mean_s"] == pytest.approx(0.4)
    assert round2["requests"] == 2 and round2["hit_rate"] == pytest.approx(150 / 200)
    assert round2["ttft_mean_s"] == pytest.approx(0.1)


def test_tiers_unknown_when_the_server_does_not_report_them() -> None:
    s = summarize("arm", [record(1, 0.2, 100, 30, 50, tiers=False)], 1.0, {})
    assert s["hit_rate"] == pytest.approx(0.3)
    assert s["hit_rate_by_tier"] == {"device": None, "host": None, "storage": None}
    assert s["tiers_reported"] is False


def test_summary_of_nothing_is_all_none() -> None:
    s = summarize("arm", [], 1.0, {})
    assert s["completed"] == 0 and s["ttft_mean_s"] is None and s["hit_rate"] is None and s["per_round"] == []


def test_the_summary_reports_the_draft_acceptance_where_the_server_speculates() -> None:
    spec = [
        record(1, 0.2, 100, 30, 50, spec_proposed_tokens=20, spec_accepted_tokens=5),
        record(1, 0.2, 100, 30, 50, spec_proposed_tokens=10, spec_accepted_tokens=4),
        record(1, 0.2, 100, 30, 50, spec_proposed_tokens=40, spec_accepted_tokens=1, error="HTTP 500: boom"),
    ]
    s = summarize("arm", spec, 1.0, {})
    assert (s["spec_proposed_tokens"], s["spec_accepted_tokens"]) == (30, 9)
    assert s["spec_acceptance_rate"] == pytest.approx(0.3)
    plain = summarize("arm", [record(1, 0.2, 100, 30, 50)], 1.0, {})
    assert plain["spec_acceptance_rate"] is None and plain["spec_proposed_tokens"] is None
