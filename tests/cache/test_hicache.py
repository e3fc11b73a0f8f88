"""The hierarchical cache keeps the invariant: outputs with host and storage hits equal the cache-off
outputs, token for token; hits are attributed to the tier that served them; nothing leaks."""

import glob
import os

import pytest

from hicache import Engine, SamplingParams
from hicache.cache.stats import PrefetchLoss
from hicache.config import DebugConfig, HiCacheConfig
from tests.conversations import make_conversations, run_turns
from tests.storage.redis_server import redis_server  # noqa: F401 - a fixture

CONVS = make_conversations(num_groups=2, per_group=3, system_len=300, question_len=40)
TURNS = 4
NEW = 24
DEVICE_TOKENS = 1024  # the conversations' working set is ~3x this


def tokens(turns):
    return [[r.token_ids for r in results] for results in turns]


def tier_totals(turns):
    totals = {"device": 0, "host": 0, "storage": 0}
    for results in turns:
        for r in results:
            assert sum(r.cached_tokens_by_tier.values()) == r.cached_tokens
            for tier, n in r.cached_tokens_by_tier.items():
                totals[tier] += n
    return totals


@pytest.fixture(scope="module")
def reference():
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        return tokens(run_turns(engine, CONVS, TURNS, NEW))


def hicache(**kw) -> HiCacheConfig:
    return HiCacheConfig(enable_hierarchical_cache=True, **kw)


def assert_clean(engine: Engine) -> None:
    """A flush frees every device and host page: none is leaked or still held."""
    assert engine.flush_cache()
    assert engine.leak_report() == []
    used = engine.pool_usage()
    assert used["device"][0] == 0 and used["host"][0] == 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_host_tier_equals_cache_off(reference, policy, layout):
    cfg = hicache(hicache_write_policy=policy, hicache_mem_layout=layout, hicache_ratio=4.0)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        totals = tier_totals(turns)
        assert totals["host"] > 0, f"no host hits: {totals}"
        assert totals["storage"] == 0
        stats = engine.cache_stats()
        assert stats.host.backup_pages > 0 and stats.host.load_pages > 0
        assert_clean(engine)


def _storage_cfg(kind: str, tmp_path, redis=None, **kw) -> HiCacheConfig:
    if kind == "file":
        return hicache(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "store"), **kw)
    return hicache(hicache_storage_backend="redis", hicache_storage_url=redis.url, **kw)


@pytest.fixture(params=["file", "redis"])
def storage_kind(request):
    if request.param == "redis":
        return "redis", request.getfixturevalue("redis_server")
    return "file", None


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_storage_after_restart_equals_cache_off(reference, tmp_path, storage_kind, policy):
    kind, redis = storage_kind
    cfg = _storage_cfg(kind, tmp_path, redis, hicache_write_policy=policy, hicache_storage_prefetch_threshold=64)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg) as engine:
        assert tokens(run_turns(engine, CONVS, TURNS, NEW)) == reference
        if policy == "write_back":
            engine.flush_cache()  # write-back stores only what is evicted; a flush evicts the rest
        stats = engine.cache_stats()
        assert stats.storage.store.puts > 0
        assert_clean(engine)
    # A new server on the same store: every page in memory is gone, storage serves the prefixes.
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        totals = tier_totals(turns)
        assert totals["storage"] > 0, totals
        stats = engine.cache_stats()
        assert stats.storage.prefetch.inserted > 0 and stats.storage.store.corrupt == 0
        assert_clean(engine)


def test_sglang_scenario_768_tokens_from_storage(tmp_path):
    """Page size 64, a 768-token prompt, pushed out of device memory, flushed, sent again."""
    cfg = hicache(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "store"))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = [(i * 31) % 200 + 33 for i in range(768)]
    with Engine(model="tiny", page_size=64, max_total_tokens=2048, hicache=cfg) as engine:
        first = engine.generate([prompt], params)[0]
        for i in range(4):  # other prompts push it out of device memory
            engine.generate([[40 + i] * 900], params)
        assert engine.flush_cache()
        again = engine.generate([prompt], params)[0]
        assert again.token_ids == first.token_ids
        assert again.cached_tokens >= 700
        assert again.cached_tokens_by_tier["storage"] >= 700
        assert_clean(engine)


def _flip_byte_in_every_object(root) -> int:
    files = [f for f in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(f)]
    for path in files:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 100)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
    return len(files)


def test_corrupt_file_objects_are_misses(tmp_path):
    cfg = hicache(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "store"))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = [(i * 7) % 90 + 33 for i in range(700)]
    with Engine(model="tiny", hicache=cfg) as engine:
        expected = engine.generate([prompt], params)[0].token_ids
        assert engine.flush_cache()
    assert _flip_byte_in_every_object(tmp_path / "store") > 0
    with Engine(model="tiny", hicache=cfg) as engine:
        result = engine.generate([prompt], params)[0]
        assert result.token_ids == expected
        assert result.cached_tokens_by_tier["storage"] == 0
        assert engine.cache_stats().storage.store.corrupt > 0
        assert_clean(engine)


def test_truncated_redis_value_is_a_miss(redis_server):  # noqa: F811
    import redis

    cfg = hicache(hicache_storage_backend="redis", hicache_storage_url=redis_server.url)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = [(i * 7) % 90 + 33 for i in range(700)]
    with Engine(model="tiny", hicache=cfg) as engine:
        expected = engine.generate([prompt], params)[0].token_ids
        assert engine.flush_cache()
    client = redis.Redis.from_url(redis_server.url)
    keys = client.keys("*")
    assert keys
    for key in keys:
        client.set(key, client.get(key)[:-10])
    with Engine(model="tiny", hicache=cfg) as engine:
        result = engine.generate([prompt], params)[0]
        assert result.token_ids == expected and result.cached_tokens_by_tier["storage"] == 0
        assert engine.cache_stats().storage.store.corrupt > 0
        assert_clean(engine)


def test_redis_outage_mid_run(reference, redis_server):  # noqa: F811
    cfg = hicache(hicache_storage_backend="redis", hicache_storage_url=redis_server.url)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[(i * k) % 90 + 33 for i in range(600)] for k in (3, 5, 7)]
    with Engine(model="tiny", disable_radix_cache=True) as off:
        expected = [r.token_ids for r in off.generate(prompts, params)]
    with Engine(model="tiny", hicache=cfg) as engine:
        redis_server.stop()
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected
        assert engine.flush_cache()
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected
        assert engine.cache_stats().storage.store.errors > 0
        redis_server.start()  # back, empty: what is written now is served later
        assert engine.flush_cache()
        engine.generate(prompts, params)
        engine.flush_cache()
        again = engine.generate(prompts, params)
        assert [r.token_ids for r in again] == expected
        assert sum(r.cached_tokens_by_tier["storage"] for r in again) > 0, "hits resume when Redis is back"
        assert_clean(engine)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_equal_cache_off(reference, tmp_path, policy):
    cfg = _storage_cfg("file", tmp_path, hicache_storage_prefetch_policy=policy, hicache_storage_prefetch_threshold=32)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg) as engine:
        run_turns(engine, CONVS, TURNS, NEW)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        if policy == "wait_complete":
            assert tier_totals(turns)["storage"] > 0
        assert_clean(engine)


@pytest.mark.slow
def test_failed_backups_become_misses(reference, monkeypatch):
    """A transfer that raises is logged, its pages are a miss (never served), the worker goes on."""
    from hicache.mem.host_pool import HostKVPool

    real = HostKVPool.backup
    calls = {"n": 0}

    def flaky(self, device, device_pages, host_pages):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("injected copy failure")
        return real(self, device, device_pages, host_pages)

    monkeypatch.setattr(HostKVPool, "backup", flaky)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=hicache(hicache_ratio=4.0)) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        stats = engine.cache_stats()
        assert stats.workers.transfer_failures > 0 and stats.host.backup_pages > 0  # half failed, half landed
        assert_clean(engine)


def test_a_host_tier_full_of_device_copies_still_prefetches_from_storage(tmp_path):
    """Host memory the size of the device pool, filled by write-through with copies of an idle prefix
    the device still holds: a prompt whose prefix is in storage must still be prefetched (the copies are
    dropped, LRU), where before the host tier refused it for good (`host_full`)."""
    cfg = hicache(
        hicache_ratio=1.0, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "store"),
        hicache_storage_prefetch_threshold=64,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    stored, idle = [(i * 7) % 200 + 33 for i in range(600)], [(i * 13) % 200 + 40 for i in range(880)]
    with Engine(model="tiny", disable_radix_cache=True) as off:
        expected = off.generate([stored], params)[0].token_ids
    with Engine(model="tiny", max_total_tokens=1024, hicache=cfg) as engine:
        assert engine.generate([stored], params)[0].token_ids == expected  # written through to storage
    with Engine(model="tiny", max_total_tokens=1024, hicache=cfg) as engine:
        engine.generate([idle], params)  # 55 pages on the device, their copies fill the 64 host pages
        result = engine.generate([stored], params)[0]
        assert result.token_ids == expected
        assert result.cached_tokens_by_tier["storage"] >= 576, result.cached_tokens_by_tier
        stats = engine.cache_stats()
        assert stats.host.host_copies_dropped_pages > 0
        assert stats.storage.prefetch.lost[PrefetchLoss.HOST_FULL] == 0
        assert_clean(engine)


@pytest.mark.slow
def test_shutdown_with_storage_puts_in_flight_leaves_only_whole_objects(reference, tmp_path):
    """Shutting down while backups and storage puts are queued: each put finishes or never starts (a
    file is renamed into place whole), so the next server finds no damaged object and no temp file."""
    store = tmp_path / "store"
    cfg = _storage_cfg("file", tmp_path, hicache_storage_prefetch_threshold=64)
    slow = DebugConfig(debug_transfer_delay_ms=30)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, debug=slow) as engine:
        assert tokens(run_turns(engine, CONVS, TURNS, NEW)) == reference
    # `with` ended right after the last answers: their backups and puts were still queued.
    assert not [p for p in store.rglob("*") if p.name.endswith(".tmp")]
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        store_stats = engine.cache_stats().storage.store
        assert store_stats.hits > 0 and store_stats.corrupt == 0
        assert_clean(engine)
