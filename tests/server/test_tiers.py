"""`cached_tokens_by_tier` and the per-tier metrics on a server with all three tiers: a prefix evicted
from the device comes back from host memory, and after a flush from storage."""

from __future__ import annotations

import pathlib

import httpx
import pytest

from tests.server.server_harness import assert_no_leaks, metric, running_servers, scrape

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

HISTORIES = ["alpha history " * 20, "bravo history " * 20, "charlie story " * 20]


def test_hits_are_reported_by_tier(tmp_path: pathlib.Path) -> None:
    args = (
        "--enable-hierarchical-cache",
        "--max-total-tokens",
        "512",  # room for two histories only
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-dir",
        str(tmp_path / "store"),
    )
    with running_servers(tmp_path, args) as (server,):

        def tiers(prompt: str) -> dict[str, int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            details = r.json()["usage"]["prompt_tokens_details"]
            assert sum(details["cached_tokens_by_tier"].values()) == details["cached_tokens"]
            return details["cached_tokens_by_tier"]

        full_pages = (len(HISTORIES[0]) - 1) // 16 * 16
        for history in HISTORIES:
            assert tiers(history) == {"device": 0, "host": 0, "storage": 0}
        # The first history was evicted from the device by the other two, and backed up to host memory.
        assert tiers(HISTORIES[0]) == {"device": 0, "host": full_pages, "storage": 0}
        assert httpx.post(f"{server.url}/flush_cache").status_code == 200
        # A flush empties device and host; storage still holds every history.
        assert tiers(HISTORIES[1]) == {"device": 0, "host": 0, "storage": full_pages}

        samples = scrape(server.url)
        assert metric(samples, "hicache_cached_tokens_total", tier="host") == full_pages
        assert metric(samples, "hicache_cached_tokens_total", tier="storage") == full_pages
        assert metric(samples, "hicache_pool_capacity_tokens", tier="device") == 512
        assert metric(samples, "hicache_pool_capacity_tokens", tier="host") > 0
        # The prefetch's lifecycle and the storage results are exported too.
        assert metric(samples, "hicache_prefetch_pages_total", stage="inserted") == full_pages // 16
        assert metric(samples, "hicache_cache_events_total", event="storage_hits") == full_pages // 16
        assert metric(samples, "hicache_cache_events_total", event="storage_corrupt") == 0
        for event in ("storage_put_failed_pages", "storage_put_retried_pages"):  # a store that stayed up
            assert metric(samples, "hicache_cache_events_total", event=event) == 0
        assert_no_leaks(server.url)
        assert metric(scrape(server.url), "hicache_pool_used_tokens", tier="host") == 0
