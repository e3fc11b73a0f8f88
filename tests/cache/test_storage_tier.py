"""The storage tier with small real pools and a real store (the file backend, and a real redis-server):
puts, the prefetch lifecycle (queried -> allocated -> read -> inserted) with the bytes checked at the
end, and every reason a page found in storage can be lost."""

from __future__ import annotations

import threading

import pytest

from hicache.cache import storage_tier as storage_tier_module
from hicache.cache.build import storage_backend
from hicache.cache.controller import TransferOp
from hicache.cache.device_tier import DeviceTier
from hicache.cache.storage_tier import StorageTier, read_batches
from hicache.cache.stores import open_store
from hicache.config import DebugConfig, HiCacheConfig
from tests.cache.kv import PAGE, assert_host_kv, compute, one_rank, settle, tiers
from tests.storage.redis_server import redis_server  # noqa: F401 - a fixture

PROMPT = list(range(40, 40 + 6 * PAGE + 1))  # six full pages, and the last token (always computed)
STORED = PROMPT[: 6 * PAGE]


@pytest.fixture(params=["file", "redis"])
def backend(request, tmp_path) -> dict:
    """HiCacheConfig fields naming one store, shared by every StorageTier a test opens."""
    if request.param == "redis":
        return {"hicache_storage_backend": "redis", "hicache_storage_url": request.getfixturevalue("redis_server").url}
    return {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path / "store")}


_opened: list[StorageTier] = []


@pytest.fixture(autouse=True)
def _shutdown():
    """Stop every tier a test opened (their workers, the store's connections)."""
    yield
    while _opened:
        tier = _opened.pop()
        tier.host.shutdown()
        tier.shutdown()


def storage_tier(backend: dict, host_pages: int = 32, fail_rate: float = 0.0, **cfg) -> tuple[StorageTier, DeviceTier]:
    """A storage tier over a fresh device + host tier (an empty tree) and the shared store."""
    device, host = tiers(device_pages=16, host_pages=host_pages)
    defaults = {"hicache_storage_prefetch_threshold": PAGE, "hicache_storage_prefetch_policy": "wait_complete"}
    config = HiCacheConfig(enable_hierarchical_cache=True, **{**defaults, **backend, **cfg})
    debug = DebugConfig(debug_storage_fail_rate=fail_rate, debug_storage_fail_rank=0)
    backend = storage_backend(config, debug, rank=0)
    store = open_store(config, device.pool, host.host.page_bytes, "test-model", "", backend)
    _opened.append(StorageTier(store, host, one_rank(), config))
    return _opened[-1], device


def store_pages(backend: dict, tokens: list[int]) -> None:
    """Compute `tokens`, back them up to the host and put them in storage, as a first server would."""
    tier, device = storage_tier(backend)
    tier.host.on_new_nodes(compute(device, tokens))
    op = tier.puts.put(settle(tier.host))
    assert op is not None
    op.done.wait()
    assert not op.failed and tier.store.stats.puts == len(tokens) // PAGE, "storage tier: the put did not land"


def prefetch(tier: StorageTier, rid: int = 1, prompt: list[int] = PROMPT, before_read=lambda: None) -> None:
    """Arrival, then scheduler checks until the read is out (queried -> allocated -> read);
    `before_read` runs once the query has answered, before the read is queued."""
    tier.start_prefetch(rid, prompt, "")
    querying = tier.querying()
    for p in querying:
        p.query.done.wait()
    before_read()
    tier.advance(querying)


def read_all(tier: StorageTier, rid: int = 1) -> None:
    read = tier.prefetches[rid].read
    if read is not None:
        read.done.wait()
    assert tier.ready_to_admit(rid, busy=False)


def lost(tier: StorageTier) -> dict[str, int]:
    return {reason.value: n for reason, n in tier.stats.prefetch.lost.items() if n}


def assert_consumed(tier: StorageTier, inserted: int, **losses: int) -> None:
    """Admission takes request 1's prefetch in: `inserted` pages reach the tree, `losses` are lost."""
    got = tier.consume(1, PROMPT, "").inserted
    assert (got, lost(tier)) == (inserted, losses), f"storage tier: {got} pages inserted, lost {lost(tier)}"


def test_the_prefetch_lifecycle_brings_the_bytes(backend):
    store_pages(backend, STORED)
    tier, _ = storage_tier(backend)
    prefetch(tier)
    read_all(tier)
    fetched = tier.consume(1, PROMPT, "")
    assert (fetched.inserted, fetched.pages) == (6, range(0, 6))
    match = tier.tree.match_prefix(STORED)
    assert match.host_tokens == len(STORED), "storage tier: the read pages were not inserted as host-only nodes"
    assert_host_kv(tier.host.host, match.host_pages, STORED, "storage")
    p = tier.stats.prefetch
    assert (p.queried, p.hit, p.allocated, p.read, p.inserted) == (6, 6, 6, 6, 6)
    assert lost(tier) == {}
    assert tier.leak_report() == []


def test_read_batches_double_up_to_the_agreed_size():
    assert list(read_batches(0, 64)) == []
    assert list(read_batches(5, 64)) == [(0, 5)]
    assert list(read_batches(100, 20)) == [(0, 8), (8, 24), (24, 44), (44, 64), (64, 84), (84, 100)]
    assert len(list(read_batches(8192, 1 << 20))) == 11  # an 8K-page hit: 11 agreements, not 1,024


def test_a_read_in_several_batches_brings_the_bytes(backend, monkeypatch):
    """Batches of 1, 2, then 3 pages: one agreed progress entry each, and every page's bytes in place."""
    monkeypatch.setattr(storage_tier_module, "PREFETCH_FIRST_BATCH_PAGES", 1)
    store_pages(backend, STORED)
    tier, _ = storage_tier(backend)
    prefetch(tier)
    read_all(tier)
    assert tier.prefetches[1].progress == [1, 3, 6]
    assert tier.consume(1, PROMPT, "").inserted == 6
    assert_host_kv(tier.host.host, tier.tree.match_prefix(STORED).host_pages, STORED, "storage")


def test_a_prompt_mostly_cached_is_not_prefetched(backend):
    store_pages(backend, STORED)
    tier, _ = storage_tier(backend, hicache_storage_prefetch_threshold=8 * PAGE)
    tier.start_prefetch(1, PROMPT, "")
    assert tier.prefetches == {} and tier.stats.prefetch.queried == 0


def test_too_small_a_hit_is_lost_below_threshold(backend):
    store_pages(backend, STORED[: 2 * PAGE])
    tier, _ = storage_tier(backend, hicache_storage_prefetch_threshold=3 * PAGE)
    prefetch(tier)
    assert tier.ready_to_admit(1, busy=False)
    assert_consumed(tier, 0, below_threshold=2)


def test_no_host_memory_is_lost_host_full(backend):
    store_pages(backend, STORED)
    tier, _ = storage_tier(backend, host_pages=4)
    prefetch(tier)
    assert_consumed(tier, 0, host_full=6)


def test_unreadable_pages_are_lost_read_failed(backend):
    store_pages(backend, STORED)
    tier, _ = storage_tier(backend, fail_rate=1.0)
    prefetch(tier)
    read_all(tier)
    assert_consumed(tier, 0, read_failed=6)
    assert tier.store.stats.misses > 0
    assert tier.host.host.allocator.free_pages == 32, "storage tier: the unread pages kept their host memory"


def test_stopping_before_the_read_is_lost_not_read_in_time(backend):
    store_pages(backend, STORED)
    tier, _ = storage_tier(backend, hicache_storage_prefetch_policy="best_effort")
    gate = threading.Event()
    # The read queues behind this (the query before it has answered: waiting on it would wait out the gate).
    prefetch(tier, before_read=lambda: tier.worker.submit(TransferOp("hold", lambda _: gate.wait(10))))
    assert tier.ready_to_admit(1, busy=True), "best effort never holds up a busy engine"
    gate.set()
    assert_consumed(tier, 0, not_read_in_time=6)


def test_pages_the_tree_got_meanwhile_are_lost_already_cached(backend):
    store_pages(backend, STORED)
    tier, device = storage_tier(backend)
    prefetch(tier)
    read_all(tier)
    host = tier.host
    host.on_new_nodes(compute(device, STORED[: 2 * PAGE]))  # another request computes them meanwhile
    settle(host)
    assert_consumed(tier, 4, already_cached=2)
    assert_host_kv(host.host, tier.tree.match_prefix(STORED).host_pages, STORED, "storage", first_page=2)


def test_a_prefix_evicted_meanwhile_loses_the_continuation(backend):
    store_pages(backend, STORED)
    tier, device = storage_tier(backend)
    compute(device, STORED[: 2 * PAGE])  # the tree holds the first two pages, on the device only
    prefetch(tier)
    assert tier.prefetches[1].start_page == 2, "storage tier: prefetched what the tree had"
    read_all(tier)
    device.evict_all()
    assert_consumed(tier, 0, prefix_evicted=4)


def test_a_request_gone_is_lost_cancelled(backend):
    store_pages(backend, STORED)
    tier, _ = storage_tier(backend)
    prefetch(tier)
    tier.cancel(1)
    assert lost(tier) == {"cancelled": 6}, f"storage tier: {lost(tier)}"
    assert tier.host.host.allocator.free_pages == 32 and tier.leak_report() == []


def test_content_addressing_writes_a_page_once(backend):
    store_pages(backend, STORED)
    tier, device = storage_tier(backend)
    tier.host.on_new_nodes(compute(device, STORED))
    tier.puts.put(settle(tier.host)).done.wait()
    assert tier.store.stats.puts == 0, "storage tier: wrote again what the store had"
    assert tier.stats.put_pages == 6


def test_a_put_during_an_outage_is_put_again_once_the_store_answers(redis_server):  # noqa: F811
    """Pages whose put found Redis down (a restart) are remembered; while it is down a request that
    reuses them tries again at most once a second; once the store answers, they are put again, once,
    and a new server reads them back."""
    backend = {"hicache_storage_backend": "redis", "hicache_storage_url": redis_server.url}
    tier, device = storage_tier(backend)
    tier.host.on_new_nodes(compute(device, STORED))
    backed_up = settle(tier.host)
    path = tier.tree.path_to_root(tier.tree.match_prefix(STORED).last_device_node)
    redis_server.stop()
    tier.puts.put(backed_up).done.wait()
    probe = tier.puts.retry(path)
    assert probe is not None, "storage tier: a put that failed was never tried again"
    probe.done.wait()
    assert tier.puts.retry(path) is None, "storage tier: retried at once while the store was down"
    assert (tier.stats.put_failed_pages, tier.stats.put_retried_pages, tier.store.stats.puts) == (12, 6, 0)
    redis_server.start()  # empty: what was put before the outage is gone too
    # A request that goes beyond the cached prefix looks storage up: that call finds the store back.
    prefetch(tier, rid=2, prompt=STORED + list(range(500, 500 + 2 * PAGE + 1)))
    tier.cancel(2)
    retry = tier.puts.retry(path)
    assert retry is not None, "storage tier: the failed put was not retried once the store answered"
    retry.done.wait()
    assert (tier.stats.put_retried_pages, tier.store.stats.puts) == (12, 6)
    assert tier.puts.retry(path) is None, "storage tier: put the same pages again"
    assert_read_back(backend)


def test_shutdown_puts_what_an_outage_kept_out(redis_server):  # noqa: F811
    backend = {"hicache_storage_backend": "redis", "hicache_storage_url": redis_server.url}
    tier, device = storage_tier(backend)
    tier.host.on_new_nodes(compute(device, STORED))
    backed_up = settle(tier.host)
    redis_server.stop()
    tier.puts.put(backed_up).done.wait()
    redis_server.start()
    _opened.remove(tier)
    tier.host.shutdown()
    tier.shutdown()
    assert tier.store.stats.puts == 6, "storage tier: shutdown left out what the outage kept out"
    assert_read_back(backend)


def assert_read_back(backend: dict) -> None:
    """A new server (an empty tree) finds the six pages in storage and reads their bytes back."""
    fresh, _ = storage_tier(backend)
    prefetch(fresh)
    read_all(fresh)
    assert fresh.consume(1, PROMPT, "").inserted == 6, "storage tier: a new server did not find the pages"
    assert_host_kv(fresh.host.host, fresh.tree.match_prefix(STORED).host_pages, STORED, "storage")
