"""The hierarchical cache through the cache API only, with small real pools: a prefix pushed out of the
device comes back from the host, after a restart from storage, with the bytes it was computed with;
hits are counted for the tier that served them; the rank consensus checker still records every
admission decision; the typed stats merge across ranks."""

from __future__ import annotations

import dataclasses
import time

import pytest

from hicache.cache.api import KVCache, KVHandle, PrefixMatch
from hicache.cache.build import hierarchical_cache
from hicache.cache.prefix_cache import PrefixCache
from hicache.cache.stats import CacheStats, HostStats, PrefetchLoss, StorageTierStats, WorkerStats
from hicache.config import HiCacheConfig
from hicache.debug.consensus_checker import ENV_ENABLE, ENV_LOG_DIR, ConsensusChecker, load_logs
from tests.cache.kv import PAGE, assert_kv, device_pool, one_rank, write_kv

A = list(range(10, 10 + 4 * PAGE + 1))  # four full pages to cache, and the last token
B = list(range(60, 60 + 4 * PAGE + 1))


def cache_for(tmp_path, storage: bool = False, **cfg) -> PrefixCache:
    fields = {"hicache_ratio": 2.0, "hicache_load_back_threshold": PAGE, "hicache_storage_prefetch_threshold": PAGE}
    if storage:
        fields |= {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path / "store")}
        fields["hicache_storage_prefetch_policy"] = "wait_complete"
    config = HiCacheConfig(enable_hierarchical_cache=True, **{**fields, **cfg})
    return hierarchical_cache(device_pool(6), config, one_rank(), "test-model")


def serve(cache: PrefixCache, rid: int, prompt: list[int]) -> KVHandle:
    """One request to the end of its prompt, as the scheduler drives the API; returns its handle,
    released, with what it reused in `handle.cached`."""
    handle = cache.open(rid, prompt, "")
    deadline = time.monotonic() + 10
    # As the scheduler does, step by step: a prefetch, or backups that lock the pages it needs, finish
    # in the background and are taken in at a check.
    while not (cache.ready_to_admit(handle, busy=False) and cache.admit(handle, -(-len(prompt) // PAGE)).admitted):
        assert time.monotonic() < deadline, "never admitted: a transfer never finished"
        time.sleep(0.001)
        cache.check()
    cache.extend(handle, len(prompt))
    wait = cache.before_layer()
    for layer in range(cache.pool.num_layers) if wait else ():
        wait(layer)
    assert_kv(cache.pool, handle.pages, prompt[: handle.kv_len], _tier_of(handle.cached))
    write_kv(cache.pool, handle.pages, prompt, start=handle.kv_len)
    handle.advance(len(prompt))
    cache.cache_prefix(handle, prompt)
    cache.release(handle, prompt)
    cache.check()
    return handle


def settle(cache: PrefixCache) -> None:
    """Let every copy in flight land and take it in at a check."""
    for op in cache.lower.host.backups.running() + cache.lower.host.loads.running():
        op.done.wait()
    cache.check()


def _tier_of(cached: PrefixMatch) -> str:
    return "/".join(tier for tier, n in cached.as_dict().items() if n) or "no"


def test_a_prefix_pushed_out_of_the_device_comes_back_from_the_host(tmp_path):
    cache = cache_for(tmp_path)
    assert isinstance(cache, KVCache)
    serve(cache, 1, A)
    serve(cache, 2, B)  # six device pages: A's are evicted, kept on the host (written through)
    again = serve(cache, 3, A)
    assert again.cached == PrefixMatch(host=4 * PAGE), f"host tier did not serve the prefix: {again.cached}"
    settle(cache)
    stats = cache.stats()
    assert stats.host.backup_pages >= 8 and stats.host.load_pages == 4 and stats.storage is None
    cache.flush()
    assert cache.leak_report() == []
    assert cache.usage() == {"device": (0, 6 * PAGE), "host": (0, 12 * PAGE)}
    cache.shutdown()


def test_after_a_restart_storage_serves_the_prefix(tmp_path):
    first = cache_for(tmp_path, storage=True)
    serve(first, 1, A)
    first.flush()  # drains the backups; their pages are queued for storage
    first.shutdown()  # ... and written before the workers stop
    restarted = cache_for(tmp_path, storage=True)
    handle = serve(restarted, 1, A)
    assert handle.cached == PrefixMatch(storage=4 * PAGE), f"storage tier did not serve the prefix: {handle.cached}"
    prefetch = restarted.stats().storage.prefetch
    assert prefetch.inserted == 4 and not any(prefetch.lost.values())
    restarted.flush()
    assert restarted.leak_report() == []
    restarted.shutdown()


def test_a_refused_admission_keeps_what_storage_brought_counted_as_storage(tmp_path):
    """The first admission attempt takes the prefetch in (its pages become host-only nodes); when that
    attempt is refused for room, the retry still reports those pages as storage hits, not host ones."""
    first = cache_for(tmp_path, storage=True)
    serve(first, 1, A)
    first.flush()
    first.shutdown()
    restarted = cache_for(tmp_path, storage=True)
    holder = restarted.open(2, B, "")
    assert restarted.admit(holder, 6).admitted  # every device page promised to another request
    handle = restarted.open(1, A, "")
    deadline = time.monotonic() + 10
    while not restarted.ready_to_admit(handle, busy=False):
        assert time.monotonic() < deadline, "the prefetch never finished"
        time.sleep(0.001)
        restarted.check()  # the read advances at the scheduler's check points
    assert not restarted.admit(handle, -(-len(A) // PAGE)).admitted
    restarted.release(holder, [])
    assert restarted.admit(handle, -(-len(A) // PAGE)).admitted
    assert handle.cached == PrefixMatch(storage=4 * PAGE), f"the retry lost the storage tier: {handle.cached}"
    restarted.release(handle, A[: handle.kv_len])
    settle(restarted)
    restarted.flush()
    assert restarted.leak_report() == []
    restarted.shutdown()


def test_selective_write_through_waits_for_the_second_hit(tmp_path):
    cache = cache_for(tmp_path, hicache_write_policy="write_through_selective")
    serve(cache, 1, A)
    serve(cache, 2, A)
    settle(cache)
    assert cache.stats().host.backup_pages == 0, "host tier: backed up a node hit once"
    serve(cache, 3, A)
    settle(cache)
    assert cache.stats().host.backup_pages == 4, "host tier: no backup at the second hit"
    cache.shutdown()


def test_write_back_keeps_an_evicted_prefix(tmp_path):
    cache = cache_for(tmp_path, hicache_write_policy="write_back")
    serve(cache, 1, A)
    settle(cache)
    assert cache.stats().host.backup_pages == 0, "host tier: write-back copied before eviction"
    serve(cache, 2, B)
    assert serve(cache, 3, A).cached == PrefixMatch(host=4 * PAGE), "host tier: write-back lost the prefix"
    cache.shutdown()


def test_the_checker_records_every_admission_decision(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ENABLE, "1")
    monkeypatch.setenv(ENV_LOG_DIR, str(tmp_path / "logs"))
    cache = cache_for(tmp_path, storage=True)
    checker = ConsensusChecker()
    for part in cache.checked_parts():
        checker.instrument(part)
    serve(cache, 7, A)
    cache.shutdown()
    checker.close()
    logs, _ = load_logs(tmp_path / "logs")
    entries = logs[0]
    by_call = {e["call"]: e for e in entries}
    admit = by_call["PrefixCache.admit"]
    assert admit["params"] == {"rid": 7, "total_pages": 5, "reserved_elsewhere": 0}
    nothing_cached = {"device": 0, "host": 0, "storage": 0}
    assert admit["result"] == {
        "result": True,
        "kv_len": 0,
        "cached_tokens_by_tier": nothing_cached,
        "reserved_pages": 5,
    }
    assert by_call["PrefixCache.release"]["params"] == {"rid": 7, "kv_len": len(A)}
    assert by_call["PrefixCache.ready_to_admit"]["params"] == {"rid": 7, "busy": False}
    assert by_call["StorageTier.consume"]["params"] == {"rid": 7}
    assert by_call["DeviceTier.alloc"]["params"] == {"n": 5}


def test_stats_merge_to_the_worst_rank():
    a = CacheStats(HostStats(backup_pages=3), StorageTierStats(), WorkerStats(transfer_failures=1))
    b = dataclasses.replace(a, host=HostStats(backup_pages=2, load_pages=5), workers=WorkerStats(2, 0))
    b.storage = StorageTierStats()
    b.storage.prefetch.lose(PrefetchLoss.READ_FAILED, 4)
    merged = CacheStats.worst([a, b])
    assert merged.host == HostStats(backup_pages=3, load_pages=5)
    assert merged.workers == WorkerStats(transfer_worker_restarts=2, transfer_failures=1)
    assert merged.storage.prefetch.lost[PrefetchLoss.READ_FAILED] == 4
    assert a.storage.prefetch.lost[PrefetchLoss.READ_FAILED] == 0, "merging changed a rank's answer"
    assert CacheStats.worst([CacheStats(), CacheStats()]) == CacheStats()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_every_policy_leaves_nothing_behind(tmp_path, policy):
    cache = cache_for(tmp_path, storage=True, hicache_write_policy=policy)
    for rid, prompt in enumerate([A, B, A, B, A]):
        serve(cache, rid, prompt)
    cache.flush()
    assert cache.leak_report() == [], f"{policy}: {cache.leak_report()}"
    cache.shutdown()
