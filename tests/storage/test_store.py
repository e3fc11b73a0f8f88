"""VerifiedStore on the in-memory fake: naming, verification, counting, and outages as misses."""

from __future__ import annotations

import logging
import threading

import pytest

from hicache.storage import Namespace, VerifiedStore, page_hashes
from hicache.storage.codec import HEADER_SIZE
from tests.storage.fakes import DictBackend

NS = Namespace(model="m", kv_dtype="bfloat16", page_size=2, layout="page_rows")


def test_put_get_and_stats() -> None:
    backend = DictBackend()
    store = VerifiedStore(backend, NS, payload_bytes=3)
    hashes = page_hashes(range(8), 2)
    assert store.put_pages(hashes[:3], [b"abc", b"def", memoryview(b"ghi")])
    assert sorted(backend.objects) == sorted(store.keys(hashes[:3]))
    got = store.get_pages(hashes)
    assert [None if p is None else bytes(p) for p in got] == [b"abc", b"def", b"ghi", None]
    assert store.exists_prefix(hashes) == 3
    assert store.stats.__dict__ == dict(
        gets=4, hits=3, misses=1, corrupt=0, puts=3, bytes_read=3 * (HEADER_SIZE + 3),
        bytes_written=3 * (HEADER_SIZE + 3), errors=0, evicted_objects=0, evicted_bytes=0, span_bytes_read=0,
    )
    assert backend.calls == {"batch_put": 1, "batch_get": 1, "exists_prefix": 1}  # one backend call each


def test_stats_are_a_snapshot() -> None:
    store = VerifiedStore(DictBackend(), NS)
    snapshot = store.stats
    snapshot.hits = 99
    assert store.stats.hits == 0


def test_caller_errors_raise() -> None:
    store = VerifiedStore(DictBackend(), NS, payload_bytes=3)
    hashes = page_hashes(range(4), 2)
    with pytest.raises(ValueError):
        store.put_pages(hashes, [b"abc"])  # one payload for two pages
    with pytest.raises(ValueError):
        store.put_pages(hashes[:1], [b"abcd"])  # not a page of this store
    with pytest.raises(ValueError):
        VerifiedStore(DictBackend(), NS, payload_bytes=0)


def test_wrong_size_object_is_corrupt() -> None:
    backend = DictBackend()
    hashes = page_hashes(range(2), 2)
    VerifiedStore(backend, NS).put_pages(hashes, [b"abcd"])
    store = VerifiedStore(backend, NS, payload_bytes=3)
    assert store.get_pages(hashes) == [None]
    assert store.stats.corrupt == 1 and backend.objects == {}


def test_namespaces_do_not_see_each_other() -> None:
    backend = DictBackend()
    hashes = page_hashes(range(4), 2)
    VerifiedStore(backend, NS).put_pages(hashes, [b"a", b"b"])
    other = VerifiedStore(backend, Namespace(model="m", kv_dtype="float32", page_size=2, layout="page_rows"))
    assert other.exists_prefix(hashes) == 0
    assert other.get_pages(hashes) == [None, None]
    assert other.stats.corrupt == 0  # a different key, not a damaged object


def test_outage_is_a_counted_miss_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    backend = DictBackend()
    store = VerifiedStore(backend, NS)
    hashes = page_hashes(range(4), 2)
    store.put_pages(hashes, [b"a", b"b"])
    backend.available = False
    with caplog.at_level(logging.INFO, logger="hicache.storage.store"):
        for _ in range(3):
            assert store.get_pages(hashes) == [None, None]
            assert store.exists_prefix(hashes) == 0
            assert store.put_pages(hashes, [b"a", b"b"]) is False
        backend.available = True
        assert [bytes(p) for p in store.get_pages(hashes)] == [b"a", b"b"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    stats = store.stats
    assert (stats.errors, stats.misses, stats.hits, stats.gets) == (9, 6, 2, 8)


def test_concurrent_use_counts_exactly() -> None:
    store = VerifiedStore(DictBackend(), NS)
    hashes = page_hashes(range(64), 2)
    store.put_pages(hashes, [bytes([i]) for i in range(32)])

    def worker() -> None:
        for _ in range(50):
            assert all(p is not None for p in store.get_pages(hashes))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.stats.hits == store.stats.gets == 4 * 50 * 32


def test_get_pages_into_reads_into_caller_buffers() -> None:
    backend = DictBackend()
    store = VerifiedStore(backend, NS, payload_bytes=4)
    hashes = page_hashes(range(8), 2)
    store.put_pages(hashes[:3], [b"aaaa", b"bbbb", b"cccc"])
    key = store.keys(hashes[1:2])[0]
    backend.objects[key] = backend.objects[key][:-1] + b"X"  # damage page 1
    host = bytearray(16)  # four pages of a "host pool", filled in place
    pages = [memoryview(host)[i * 4 : (i + 1) * 4] for i in range(4)]
    assert store.get_pages_into(hashes, pages) == [True, False, True, False]
    assert host[:4] == b"aaaa" and host[8:12] == b"cccc"
    stats = store.stats
    assert (stats.gets, stats.hits, stats.misses, stats.corrupt) == (4, 2, 2, 1)
    assert key not in backend.objects
    with pytest.raises(ValueError):
        store.get_pages_into(hashes[:1], [bytearray(5)])  # not a page of this store
    with pytest.raises(ValueError):
        store.get_pages_into(hashes[:1], [b"read"])  # not writable
    with pytest.raises(ValueError):
        store.get_pages_into(hashes, pages[:1])
    backend.available = False
    assert store.get_pages_into(hashes[:1], pages[:1]) == [False]
    assert store.stats.errors == 1
