"""Storage backend on a Redis server: a store shared by every engine that can reach it.

Batch operations are pipelined so a batch costs one round trip (~75 µs on loopback) instead of one per
page: exists_prefix is one server-side script per chunk (chunks doubling), batch_get one MGET, batch_put one
pipeline of SET.
get_range and batch_read_ranges are GETRANGE, so a reader of part of an object (unified layout) moves
only that part; batch_put_ranges is SETRANGE at each part's offset, in one MULTI/EXEC.

Failure policy: the storage tier is an optimisation, so an unreachable server must cost a bounded stall
and a miss, never a hang. Sockets time out after `timeout_s` (default 1 s), and redis-py's default retry
policy (10 retries with exponential backoff, seconds of stall per call against a dead server) is replaced
by one immediate retry on connection errors only: a connection that breaks mid-call (a restart in
between) is retried once on a fresh socket, while a hung server costs one timeout, not several. Every
redis error surfaces as StorageUnavailable. There is no broken state to recover from: the pool discards
a socket the server has closed before reusing it, so the first call after a restart already succeeds.

Run the server as a cache (`maxmemory` with `maxmemory-policy allkeys-lru`): at maxmemory without an
eviction policy Redis refuses writes, which this backend reports as StorageUnavailable.

Retention hints (docs/DESIGN.md, "retention hints") reach Redis only through expiry: Redis's LRU and LFU
count uses up to now and no later. With `idle_ttl_s` (`--hicache-storage-idle-ttl`) every object expires
that long after its last use: a put sets it, a read or a touch moves it later (never earlier), and a
retained page's touch at the end of its retention moves it that much further. Under
`maxmemory-policy volatile-ttl`, which evicts the nearest expiry first, Redis's eviction is then least
recently used first with the hints' credit, the file store's order; an object idle for `idle_ttl_s`
expires even without pressure.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from typing import cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from hicache.errors import UserError
from hicache.storage.backend import (
    Blob,
    BytesLike,
    StorageBackend,
    StorageUnavailable,
    check_key,
    check_keys,
    check_range,
    join_blob,
)

logger = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
_PREFIX_RE = re.compile(r"[0-9A-Za-z_:-]*")  # no glob metacharacters: clear() matches on it with SCAN
# How many leading KEYS exist, answered by the server in one command, stopping at the first missing one:
# a pipeline of EXISTS costs redis-py ~8 us of Python per key (docs/BENCHMARKS.md, "Prompt-length paths").
_LEADING_KEYS = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then return i - 1 end
end
return #KEYS
"""
# Each KEY's expiry moved to ARGV[1] ms from now, unless it is later already (GT; a key without one has
# none to move: objects written before expiries were used stay as they are).
_EXPIRE_LATER = """
for i, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ARGV[1], 'GT') end
return 0
"""


def open_backend(
    url: str, idle_ttl: float, prefix: str = "hicache:", timeout_s: float = 1.0, exists_chunk: int = 256
) -> RedisBackend:
    """`--hicache-storage-backend redis` (registry.py): at `url`, objects expiring `idle_ttl` seconds after
    their last use if > 0; extra config: the key `prefix` (several deployments in one database), the
    per-command `timeout_s`, the first existence query's `exists_chunk`. Connections are lazy: an
    unreachable Redis is reported by the first operation as StorageUnavailable, not here."""
    try:
        return RedisBackend(url, prefix=prefix, timeout_s=timeout_s, exists_chunk=exists_chunk, idle_ttl_s=idle_ttl)
    except ValueError as exc:
        raise UserError(f"--hicache-storage-backend redis: {exc}") from exc


class RedisBackend(StorageBackend):
    """Objects as Redis strings named f"{prefix}{key}".

    The prefix keeps clear() to this engine's objects when the database is shared with anything else.
    `exists_chunk` is the first existence query's size, each next one twice the last: a long prompt whose
    first pages are missing costs one small round trip, not one sized by the whole prompt, and a hit of
    n pages costs about log2(n / exists_chunk) round trips."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = "hicache:",
        timeout_s: float = 1.0,
        health_check_interval_s: int = 10,
        exists_chunk: int = 256,
        idle_ttl_s: float = 0.0,
    ) -> None:
        """`idle_ttl_s`: each object expires that long after its last use (0: never; the module docstring)."""
        if _PREFIX_RE.fullmatch(prefix) is None:
            raise ValueError(f"invalid key prefix {prefix!r}: expected characters from [0-9A-Za-z_:-]")
        if exists_chunk <= 0:
            raise ValueError(f"exists_chunk must be positive, got {exists_chunk}")
        if not idle_ttl_s >= 0:
            raise ValueError(f"idle_ttl_s must be >= 0, got {idle_ttl_s}")
        self._idle_ms = round(idle_ttl_s * 1000)
        self.url = url
        self.prefix = prefix
        self.exists_chunk = exists_chunk
        # from_url raises ValueError for a malformed URL; no connection is made until the first command.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=health_check_interval_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        # EVALSHA, loading the script again after a restart emptied the server's script cache.
        self._leading_keys = self._client.register_script(_LEADING_KEYS)
        self._expire_later = self._client.register_script(_EXPIRE_LATER)

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextlib.contextmanager
    def _reachable(self, what: str) -> Iterator[None]:
        try:
            yield
        except redis.DataError:
            raise  # a value redis-py cannot send is a caller bug, not an outage
        except (redis.RedisError, OSError) as exc:
            raise StorageUnavailable(f"redis {what} at {self.url}: {exc}") from exc

    def ping(self) -> None:
        """Raise StorageUnavailable unless the server answers (for start-up checks and health endpoints)."""
        with self._reachable("PING"):
            self._client.ping()

    def exists_prefix(self, keys: list[str]) -> int:
        check_keys(keys)
        prefix = self.prefix
        names = [prefix + k for k in keys]
        found, chunk = 0, self.exists_chunk
        with self._reachable("EXISTS script"):
            while found < len(names):
                batch = names[found : found + chunk]
                present = int(self._leading_keys(keys=batch))
                found += present
                if present < len(batch):
                    break
                chunk *= 2
        return found

    def get(self, key: str) -> bytes | None:
        name = self._name(key)
        with self._reachable("GET"):
            data = cast("bytes | None", self._client.get(name))  # bytes: decode_responses is off
            self._used([name])
        return data

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self._name(k) for k in keys]
        with self._reachable("MGET"):
            data = cast("list[bytes | None]", self._client.mget(names))
            self._used(names)
        return data

    def put(self, key: str, blob: Blob) -> None:
        name = self._name(key)
        with self._reachable("SET"):
            # A SET takes one value: parts are joined (one copy).
            self._client.set(name, join_blob(blob), px=self._idle_ms or None)

    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> None:
        if not items:
            return
        named = [(self._name(k), join_blob(blob)) for k, blob in items]
        with self._reachable("SET pipeline"):
            pipe = self._client.pipeline(transaction=False)
            for name, blob in named:
                pipe.set(name, blob, px=self._idle_ms or None)
            pipe.execute()

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        check_range(offset, length)
        name = self._name(key)
        with self._reachable("GETRANGE"):
            pipe = self._client.pipeline(transaction=False)
            # GETRANGE answers "" for a missing key, so existence is asked in the same round trip. Its end
            # is inclusive, and an end of -1 would mean "to the end": a zero-length range skips it.
            pipe.exists(name)
            if length:
                pipe.getrange(name, offset, offset + length - 1)
            present, *data = pipe.execute()
            self._used([name])
        if not present:
            return None
        return data[0] if data else b""

    def batch_read_ranges(self, items: Sequence[tuple[str, Sequence[tuple[int, memoryview]]]]) -> list[int | None]:
        if not items:
            return []
        names = [self._name(k) for k, _ in items]
        with self._reachable("GETRANGE pipeline"):
            # One round trip for the batch: per object EXISTS (GETRANGE answers "" for a missing key),
            # then one GETRANGE per range (inclusive end; a zero-length range is not asked).
            pipe = self._client.pipeline(transaction=False)
            for name, (_, ranges) in zip(names, items):
                pipe.exists(name)
                for offset, buf in ranges:
                    check_range(offset, buf.nbytes)
                    if buf.nbytes:
                        pipe.getrange(name, offset, offset + buf.nbytes - 1)
            replies = iter(pipe.execute())
            self._used(names)
        out: list[int | None] = []
        for _, ranges in items:
            present = next(replies)
            total = 0
            for _, buf in ranges:
                data = next(replies) if buf.nbytes else b""
                buf[: len(data)] = data
                total += len(data)
            out.append(total if present else None)
        return out

    def batch_put_ranges(self, items: Sequence[tuple[str, int, Sequence[tuple[int, BytesLike]]]]) -> None:
        if not items:
            return
        # SETRANGE builds each object in place, part by part, inside one MULTI/EXEC per batch, so no
        # reader sees it half written; the zero byte at size-1 sets its length (gaps read as zeros).
        named = [(self._name(k), size, parts) for k, size, parts in items]
        with self._reachable("SETRANGE transaction"):
            pipe = self._client.pipeline(transaction=True)
            for name, size, parts in named:
                pipe.delete(name)
                if size:
                    pipe.setrange(name, size - 1, b"\x00")
                for offset, part in parts:
                    pipe.setrange(name, offset, bytes(memoryview(part).cast("B")))
                if self._idle_ms:
                    pipe.pexpire(name, self._idle_ms)
            pipe.execute()

    def touch(self, keys: list[str], at: float | None = None) -> None:
        """TOUCH (what a maxmemory LRU or LFU policy counts as an access, now whatever `at` says); with
        `idle_ttl_s`, also each expiry moved to `idle_ttl_s` past `at` (a retention credit, the module
        docstring)."""
        check_keys(keys)
        if keys:
            names = [self.prefix + k for k in keys]
            with self._reachable("TOUCH"):
                self._client.touch(*names)
                self._used(names, 0.0 if at is None else max(0.0, at - time.time()))

    def _used(self, names: list[str], later_s: float = 0.0) -> None:
        """With `idle_ttl_s`: the objects `names` were used, `later_s` seconds from now (their expiries,
        never earlier). Inside the caller's `_reachable`."""
        if self._idle_ms and names:
            self._expire_later(keys=names, args=[self._idle_ms + round(later_s * 1000)])

    def delete(self, key: str) -> None:
        name = self._name(key)
        with self._reachable("UNLINK"):
            self._client.unlink(name)

    def clear(self) -> None:
        with self._reachable("SCAN/UNLINK"):
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=self.prefix + "*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)
        logger.info("cleared redis storage %s*", self.prefix)

    def close(self) -> None:
        self._client.close()
