"""/metrics: every metric the design names, with values that follow the requests just made."""

from __future__ import annotations

import httpx

from tests.server.server_harness import metric, scrape

PREFIX = "A prompt long enough to fill a few pages of the cache, then reused. " * 2


def test_metrics_follow_requests(server: str) -> None:
    before = scrape(server)
    for suffix in ("first", "second"):  # the second request reuses the first one's pages
        body = {"model": "tiny", "prompt": PREFIX + suffix, "max_tokens": 5, "temperature": 0.0}
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
    httpx.post(f"{server}/v1/completions", json={"model": "nope", "prompt": "x"})
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt_tokens = 2 * len(PREFIX.encode()) + len(b"first") + len(b"second")
    assert delta("hicache_prompt_tokens_total") == prompt_tokens
    assert delta("hicache_generation_tokens_total") == 10
    assert delta("hicache_cached_tokens_total", tier="device") >= len(PREFIX.encode()) // 16 * 16
    assert delta("hicache_cached_tokens_total", tier="host") == 0
    assert delta("hicache_cached_tokens_total", tier="storage") == 0
    assert delta("hicache_time_to_first_token_seconds_count") == 2
    assert delta("hicache_time_to_first_token_seconds_sum") > 0
    assert delta("hicache_requests_total", status="length") == 2
    assert delta("hicache_requests_total", status="rejected") == 1
    assert metric(after, "hicache_pool_capacity_tokens", tier="device") == 32768
    assert 0 < metric(after, "hicache_pool_used_tokens", tier="device") <= 32768  # the cached prefix
    assert metric(after, "hicache_requests_running") == 0
    assert metric(after, "hicache_requests_waiting") == 0
