"""Retention hints over HTTP (docs/DESIGN.md, "retention hints"): under device pressure a history sent with
a `priority` stays on the device where plain LRU moves it to host memory (the hit counts by tier say so),
its answers stay the cache-off server's, and once its `retention_seconds` have passed it is evicted like
any other. In process, over one real tiny engine with a device and a host tier, after a cache-off one."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig
from hicache.server.app import create_app

PAGE = 16  # tiny's page, in byte tokens
# Three histories of 10 full pages each; the device (24 pages) holds two and the third's admission.
HISTORIES = [f"{name} history " * 12 for name in ("alpha", "bravo", "charlie")]
FULL_PAGES = (len(HISTORIES[0]) - 1) // PAGE * PAGE
NOTHING_CACHED = {"device": 0, "host": 0, "storage": 0}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    hicache = HiCacheConfig(enable_hierarchical_cache=True)
    engine = Engine(model="tiny", max_total_tokens=24 * PAGE, hicache=hicache)
    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(scope="module")
def cache_off() -> dict[str, str]:
    """Each history's greedy answer from an engine with the radix cache off."""
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        results = engine.generate(HISTORIES, SamplingParams(max_new_tokens=4, temperature=0.0))
    return {history: r.text for history, r in zip(HISTORIES, results)}


def complete(client: TestClient, prompt: str, **hint) -> tuple[str, dict[str, int]]:
    """The greedy answer and the prompt tokens served from each tier."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, **hint}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]


def under_pressure(client: TestClient, cache_off: dict[str, str], **hint) -> dict[str, int]:
    """From an empty cache: the first history (with `hint`), then the other two, which need the room of
    one of the first two; then each again. Every answer is the cache-off one. Where the first history's
    second turn was served from."""
    assert client.post("/flush_cache").status_code == 200
    for i, history in enumerate(HISTORIES):
        assert complete(client, history, **(hint if i == 0 else {})) == (cache_off[history], NOTHING_CACHED)
    answer, tiers = complete(client, HISTORIES[0])
    assert answer == cache_off[HISTORIES[0]]
    for history in HISTORIES[1:]:
        assert complete(client, history)[0] == cache_off[history]
    return tiers


def retention_metrics(client: TestClient) -> dict[tuple[str, str], float]:
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name.startswith("hicache_retention_"):
                samples[(s.name, s.labels.get("tier", ""))] = s.value
    return samples


def test_a_retained_history_stays_on_the_device_where_lru_moves_it(
    client: TestClient, cache_off: dict[str, str]
) -> None:
    assert under_pressure(client, cache_off) == {"device": 0, "host": FULL_PAGES, "storage": 0}, "LRU evicts it"
    tiers = under_pressure(client, cache_off, priority=5, retention_seconds=600)
    assert tiers == {"device": FULL_PAGES, "host": 0, "storage": 0}, "the retained history was evicted"
    metrics = retention_metrics(client)
    assert metrics[("hicache_retention_held_pages", "device")] > 0
    assert metrics[("hicache_retention_deferred_evictions_total", "device")] >= 1
    assert metrics[("hicache_retention_evicted_pages_total", "device")] == 0


def test_a_lapsed_retention_is_evicted_like_any_other(client: TestClient, cache_off: dict[str, str]) -> None:
    lapsed_before = retention_metrics(client)[("hicache_retention_lapsed_nodes_total", "")]
    assert client.post("/flush_cache").status_code == 200
    complete(client, HISTORIES[0], priority=5, retention_seconds=0.5)
    time.sleep(1.0)  # the next arrivals come after the retention ran out
    for history in HISTORIES[1:]:
        complete(client, history)
    assert complete(client, HISTORIES[0]) == (cache_off[HISTORIES[0]], {"device": 0, "host": FULL_PAGES, "storage": 0})
    assert retention_metrics(client)[("hicache_retention_lapsed_nodes_total", "")] > lapsed_before
