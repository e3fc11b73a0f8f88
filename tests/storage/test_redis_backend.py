"""RedisBackend against a real redis-server: round trips through VerifiedStore, damaged values, and an
outage (server stopped, server hung) followed by a restart."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from hicache.errors import UserError
from hicache.storage import Namespace, RedisBackend, StorageUnavailable, VerifiedStore, page_hashes
from tests.storage.conftest import opened
from tests.storage.redis_server import RedisServer

NS = Namespace(model="m", kv_dtype="bfloat16", page_size=16, layout="page_rows", rank="tp0of1")
PAGE_BYTES = 16 * 23040  # one smollm2 bf16 page


def payloads(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([(i + salt) % 256]) * PAGE_BYTES for i in range(n)]


def test_round_trip_and_exists_prefix(redis_server: RedisServer) -> None:
    backend = opened("redis", url=redis_server.url)
    assert isinstance(backend, RedisBackend)
    store = VerifiedStore(backend, NS, payload_bytes=PAGE_BYTES)
    hashes = page_hashes(range(16 * 8), 16)
    assert store.exists_prefix(hashes) == 0
    assert store.put_pages(hashes[:5], payloads(5))
    assert store.exists_prefix(hashes) == 5
    got = store.get_pages(hashes)
    assert [None if p is None else bytes(p) for p in got] == payloads(5) + [None] * 3
    stats = store.stats
    assert (stats.gets, stats.hits, stats.misses, stats.corrupt, stats.puts) == (8, 5, 3, 0, 5)
    assert stats.bytes_written == stats.bytes_read == 5 * (PAGE_BYTES + 64)
    # The objects are where the key scheme says, under the backend's prefix.
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.exists(f"hicache:{NS.object_key(hashes[0])}") == 1
    # Another deployment in the same database, its own prefix given as the backend's extra option.
    other = VerifiedStore(opened("redis", url=redis_server.url, backend_extra_config='{"prefix": "team-b:"}'), NS)
    assert other.exists_prefix(hashes) == 0 and other.put_pages(hashes[:1], payloads(1))
    assert raw.exists(f"team-b:{NS.object_key(hashes[0])}") == 1
    raw.close()
    backend.close()


def test_touch_is_an_access_to_redis_lru(redis_server: RedisServer) -> None:
    """A capped Redis (maxmemory, an LRU policy) evicts by idle time: a touched page's is reset."""
    store = VerifiedStore(opened("redis", url=redis_server.url), NS, payload_bytes=PAGE_BYTES)
    hashes = page_hashes(range(16 * 2), 16)
    assert store.put_pages(hashes, payloads(2))
    raw = redis.Redis.from_url(redis_server.url)
    names = [f"hicache:{NS.object_key(h)}" for h in hashes]
    time.sleep(1.1)  # OBJECT IDLETIME counts whole seconds
    store.touch(hashes[:1])
    assert raw.object("idletime", names[0]) == 0 and raw.object("idletime", names[1]) >= 1
    raw.close()
    store.backend.close()


def test_with_an_idle_ttl_volatile_ttl_evicts_least_recently_used_and_keeps_a_retained_page(
    redis_server: RedisServer,
) -> None:
    """`--hicache-storage-idle-ttl` (docs/DESIGN.md, "retention hints"): every object expires that long
    after its last use, a retained page's touch moves that to past its retention's end, and a read never
    moves it back; so under maxmemory with `volatile-ttl` Redis evicts the least recently used first and the
    retained page after them."""
    backend = RedisBackend(redis_server.url, idle_ttl_s=600)
    store = VerifiedStore(backend, NS, payload_bytes=PAGE_BYTES)
    raw = redis.Redis.from_url(redis_server.url)
    hashes = page_hashes(range(16 * 24), 16)
    names = [f"hicache:{NS.object_key(h)}" for h in hashes]
    assert store.put_pages(hashes[:10], payloads(10))
    assert 599_000 < raw.pttl(names[0]) <= 600_000
    time.sleep(0.05)
    store.touch(hashes[:1], at=time.time() + 3600)  # retained for an hour
    assert store.get_pages(hashes[:1])[0] is not None  # a read now does not take the credit back
    assert 4_199_000 < raw.pttl(names[0]) <= 4_200_000
    store.touch(hashes[5:10])  # used now: later than the other plain ones
    # Room for about 14 objects beyond what the server holds besides them, sampled exactly.
    baseline = int(raw.info("memory")["used_memory"]) - 10 * PAGE_BYTES
    raw.config_set("maxmemory-samples", 64)
    raw.config_set("maxmemory-policy", "volatile-ttl")
    raw.config_set("maxmemory", baseline + 14 * PAGE_BYTES)
    assert store.put_pages(hashes[10:20], payloads(10, salt=10))
    assert raw.exists(names[0]) == 1, "the retained page was evicted"
    # The plain pages by last use, in groups used together (within a millisecond: ties, in any order):
    # 1-4 (put), 5-9 (touched), 10-19 (put last). What went is the oldest groups'.
    groups = [[raw.exists(n) == 1 for n in names[a:b]] for a, b in ((1, 5), (5, 10), (10, 20))]
    last = max(g for g, group in enumerate(groups) if not all(group))
    assert not any(p for group in groups[:last] for p in group) and all(p for g in groups[last + 1 :] for p in g)
    assert sum(not p for group in groups for p in group) >= 4, groups
    raw.close()
    backend.close()


def test_truncated_and_foreign_values_are_corrupt_misses(redis_server: RedisServer) -> None:
    backend = RedisBackend(redis_server.url)
    store = VerifiedStore(backend, NS)
    hashes = page_hashes(range(16 * 3), 16)
    assert store.put_pages(hashes, payloads(3))
    raw = redis.Redis.from_url(redis_server.url)
    name = f"hicache:{NS.object_key(hashes[1])}"
    raw.set(name, raw.getrange(name, 0, 1000))  # truncated, as by a half-finished copy
    other = Namespace(model="another model", kv_dtype="bfloat16", page_size=16, layout="page_rows")
    # Another namespace's object under this namespace's key (only a bug or a copy could do this).
    VerifiedStore(backend, other).put_pages(hashes[2:3], payloads(1))
    raw.set(f"hicache:{NS.object_key(hashes[2])}", raw.get(f"hicache:{other.object_key(hashes[2])}"))
    raw.close()

    got = store.get_pages(hashes)
    assert bytes(got[0]) == payloads(1)[0] and got[1] is None and got[2] is None
    assert (store.stats.hits, store.stats.corrupt, store.stats.misses) == (1, 2, 2)
    assert store.exists_prefix(hashes) == 1  # the corrupt objects were deleted
    backend.close()


def test_stopped_server_is_a_bounded_miss_and_restart_resumes(redis_server: RedisServer) -> None:
    backend = RedisBackend(redis_server.url)
    store = VerifiedStore(backend, NS)
    hashes = page_hashes(range(16 * 4), 16)
    assert store.put_pages(hashes[:2], payloads(2))

    redis_server.stop()
    with pytest.raises(StorageUnavailable):
        backend.get(NS.object_key(hashes[0]))
    for call in (
        lambda: store.get_pages(hashes),
        lambda: store.exists_prefix(hashes),
        lambda: store.put_pages(hashes[2:], payloads(2, salt=2)),
    ):
        start = time.monotonic()
        result = call()  # no exception escapes
        assert time.monotonic() - start < 3.0
        assert result in ([None] * 4, 0, False)
    stats = store.stats
    assert stats.errors == 3 and stats.misses == 4 and stats.hits == 0

    redis_server.start()  # same port, empty store (no persistence)
    assert store.exists_prefix(hashes) == 0  # the first call after the restart already works
    assert store.put_pages(hashes, payloads(4, salt=7))
    assert [bytes(p) for p in store.get_pages(hashes)] == payloads(4, salt=7)
    assert store.stats.errors == 3
    backend.close()


def test_hung_server_costs_one_timeout(redis_server: RedisServer) -> None:
    # SIGSTOP: the socket accepts but nothing answers, the worst case for a client. Each call must give
    # up after about the socket timeout instead of retrying with backoff.
    backend = RedisBackend(redis_server.url, timeout_s=0.5)
    store = VerifiedStore(backend, NS)
    hashes = page_hashes(range(16 * 2), 16)
    assert store.put_pages(hashes, payloads(2))
    pid = redis_server.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert store.get_pages(hashes) == [None, None]
        assert store.exists_prefix(hashes) == 0
        assert time.monotonic() - start < 3.0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [bytes(p) for p in store.get_pages(hashes)] == payloads(2)
    assert store.stats.errors == 2
    backend.close()


def test_configuration_errors() -> None:
    with pytest.raises(UserError, match="redis://"):
        opened("redis", url="http://localhost:6379")
    with pytest.raises(UserError, match="must be one of file, redis"):
        opened("s3")
    with pytest.raises(UserError, match="takes no extra option 'ttl' .its own: prefix, timeout_s, exists_chunk"):
        opened("redis", backend_extra_config='{"ttl": 5}')
    with pytest.raises(UserError, match="--hicache-storage-idle-ttl applies to --hicache-storage-backend redis only"):
        opened("file", idle_ttl=5.0)
    with pytest.raises(ValueError):
        RedisBackend(prefix="bad*prefix")


def test_silent_restart_between_calls_is_not_even_a_miss(redis_server: RedisServer) -> None:
    # The pool holds a connection to the old server process; it must be replaced transparently, so the
    # first call after a restart nobody saw still succeeds.
    backend = RedisBackend(redis_server.url)
    store = VerifiedStore(backend, NS)
    hashes = page_hashes(range(16), 16)
    assert store.put_pages(hashes, payloads(1))
    redis_server.stop()
    redis_server.start()
    assert store.put_pages(hashes, payloads(1, salt=3))
    assert [bytes(p) for p in store.get_pages(hashes)] == payloads(1, salt=3)
    assert store.stats.errors == 0
    backend.close()
