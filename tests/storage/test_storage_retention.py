"""Retention hints in a store that evicts by itself (docs/DESIGN.md, "retention hints"): a retained page is
touched at the end of its retention, a use in the future, so the store's own LRU takes it after every page
used before then. Over a real tiny engine with device, host and a capped store (a file store with
`--hicache-storage-max-bytes`; Redis with maxmemory, `volatile-ttl` and `--hicache-storage-idle-ttl`): a
history sent with a hint is still whole in the store after two others pushed it past its cap (a restarted
server reads all of it from storage, with the cache-off answer), where without the hint the cap took its
first pages."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig
from hicache.storage import FileBackend
from tests.storage.redis_server import RedisServer

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PAGE = 16  # tiny's page, in byte tokens
HISTORIES = [f"{name} history " * 12 for name in ("alpha", "bravo", "charlie")]  # 10 full pages each
FULL_PAGES = (len(HISTORIES[0]) - 1) // PAGE * PAGE
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


class FileStore:
    """A file store capped by `--hicache-storage-max-bytes`."""

    def __init__(self, root: Path) -> None:
        self.root, self.cap = root, 0

    def config(self) -> dict:
        return {"hicache_storage_backend": "file", "hicache_storage_dir": str(self.root),
                "hicache_storage_max_bytes": self.cap}  # fmt: skip

    def objects(self) -> list[int]:
        """The size of each stored object."""
        return [e.stat().st_size for d in self.root.iterdir() if d.is_dir() for e in os.scandir(d)
                if not e.name.startswith(".")]  # fmt: skip

    def clear_and_cap(self, objects: int) -> None:
        """Empty, and room for `objects` of the size stored."""
        self.cap = objects * max(self.objects())
        FileBackend(self.root).clear()


class RedisStore:
    """A Redis server with maxmemory and `volatile-ttl`, objects put with `--hicache-storage-idle-ttl`."""

    def __init__(self, server: RedisServer) -> None:
        self.server, self.raw = server, redis.Redis.from_url(server.url)

    def config(self) -> dict:
        return {"hicache_storage_backend": "redis", "hicache_storage_url": self.server.url,
                "hicache_storage_idle_ttl": 3600.0}  # fmt: skip

    def objects(self) -> list[int]:
        return [self.raw.memory_usage(name) for name in self.raw.scan_iter("hicache:*")]

    def clear_and_cap(self, objects: int) -> None:
        size = max(self.objects())
        self.raw.flushdb()
        self.raw.config_set("maxmemory-samples", 64)  # every key sampled: the exact order, for a test
        self.raw.config_set("maxmemory-policy", "volatile-ttl")
        self.raw.config_set("maxmemory", int(self.raw.info("memory")["used_memory"]) + objects * size)


def engine(store: FileStore | RedisStore) -> Engine:
    hicache = HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_prefetch_threshold=PAGE, **store.config())
    return Engine(model="tiny", max_total_tokens=24 * PAGE, hicache=hicache)


def first_history_from_storage(store: FileStore | RedisStore, **hint) -> tuple[str, dict[str, int]]:
    """The three histories into an empty store that holds two and a half of them (the first with `hint`),
    then the first again on a restarted server: its answer and where its prompt came from."""
    with engine(store) as probe:  # one history's objects, to size the cap
        probe.generate([HISTORIES[0]], GREEDY)
    store.clear_and_cap(25)
    with engine(store) as first:
        for i, history in enumerate(HISTORIES):
            first.submit(history, GREEDY, **(hint if i == 0 else {})).result()
            time.sleep(0.01)  # uses a put apart, whatever the store's clock resolution
    assert len(store.objects()) < 3 * FULL_PAGES // PAGE, "the cap never evicted: the test would prove nothing"
    with engine(store) as restarted:
        result = restarted.generate([HISTORIES[0]], GREEDY)[0]
    return result.text, result.cached_tokens_by_tier


@pytest.fixture(scope="module")
def cache_off() -> str:
    with Engine(model="tiny", disable_radix_cache=True) as off:
        return off.generate([HISTORIES[0]], GREEDY)[0].text


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_a_retained_history_outlives_a_capped_stores_lru(kind: str, tmp_path: Path, cache_off: str) -> None:
    def store(name: str) -> FileStore | RedisStore:
        if kind == "file":
            return FileStore(tmp_path / name)
        (tmp_path / name).mkdir()
        server = RedisServer(tmp_path / name)
        server.start()
        servers.append(server)
        return RedisStore(server)

    servers: list[RedisServer] = []
    try:
        answer, tiers = first_history_from_storage(store("lru"))
        assert answer == cache_off and tiers["storage"] == 0, "plain LRU took the first history's first pages"
        answer, tiers = first_history_from_storage(store("hinted"), priority=5, retention_seconds=600)
    finally:
        for server in servers:
            server.stop()
    assert answer == cache_off
    assert tiers == {"device": 0, "host": 0, "storage": FULL_PAGES}, "the retained history left the store"
