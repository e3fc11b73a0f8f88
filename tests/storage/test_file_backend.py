"""FileBackend specifics: atomic writes, confinement to its directory, damaged files, default location."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.errors import UserError
from hicache.storage import (
    CorruptObject,
    FileBackend,
    Namespace,
    StorageUnavailable,
    VerifiedStore,
    decode,
    default_storage_dir,
    encode,
    page_hashes,
)
from tests.storage.conftest import opened

NS = Namespace(model="m", kv_dtype="bfloat16", page_size=4, layout="page_rows")


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_layout_and_no_temp_files_left(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, fsync=True)
    store = VerifiedStore(backend, NS)
    hashes = page_hashes(range(40), 4)
    assert store.put_pages(hashes, [bytes([i]) * 100 for i in range(10)])
    files = all_files(tmp_path)
    assert [f.name for f in files] == sorted(NS.object_key(h) for h in hashes)
    assert all(f.parent.name == f.name[:2] and f.parent.parent == tmp_path for f in files)


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = FileBackend(tmp_path)
    key = NS.object_key(page_hashes(range(4), 4)[0])
    backend.put(key, b"old object")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StorageUnavailable):
        backend.put(key, b"new object")
    monkeypatch.undo()
    assert backend.get(key) == b"old object"  # the old object survives whole
    assert [f.name for f in all_files(tmp_path)] == [key]  # the temp file was removed


def test_concurrent_reader_never_sees_a_partial_object(tmp_path: Path) -> None:
    # Large objects (several write() chunks) written for the first time, then rewritten in a loop, while
    # another thread reads them: every read is nothing (before the first put completes) or a complete,
    # verifiable object, old or new.
    backend = FileBackend(tmp_path)
    page_hash = page_hashes(range(4), 4)[0]
    key = NS.object_key(page_hash)
    versions = [encode(page_hash, NS.digest, bytes([v]) * (4 << 20)) for v in range(4)]
    stop = threading.Event()
    started = threading.Event()
    errors: list[str] = []
    seen = {"absent": 0, "whole": 0}

    def reader() -> None:
        while not stop.is_set():
            blob = backend.get(key)
            started.set()
            if blob is None:
                seen["absent"] += 1
                if seen["whole"]:
                    errors.append("object vanished")
                continue
            try:
                decode(blob, page_hash, NS.digest)
                seen["whole"] += 1
            except CorruptObject as exc:
                errors.append(exc.reason)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        started.wait(5)
        for i in range(40):
            backend.put(key, versions[i % 4])
    finally:
        stop.set()
        thread.join()
    assert errors == [] and seen["whole"] > 0
    assert [f.name for f in all_files(tmp_path)] == [key]


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=0, max_size=40))
def test_arbitrary_keys_never_escape_the_root(tmp_path: Path, key: str) -> None:
    root = tmp_path / "sandbox" / "store"
    root.mkdir(parents=True, exist_ok=True)
    backend = FileBackend(root)
    try:
        backend.put(key, b"x")
    except ValueError:
        return
    finally:
        # Nothing ever lands beside the store, whatever the key.
        assert [p.name for p in (tmp_path / "sandbox").iterdir()] == ["store"]
    assert (root / key[:2] / key).read_bytes() == b"x"
    assert all(root in p.parents for p in root.rglob("*"))


@pytest.mark.parametrize("read_path", ["get_pages", "get_pages_into"])
def test_flipped_byte_on_disk_is_a_counted_corrupt_miss(tmp_path: Path, read_path: str) -> None:
    backend = FileBackend(tmp_path)
    store = VerifiedStore(backend, NS)
    hashes = page_hashes(range(12), 4)
    payloads = [bytes([i]) * 1000 for i in range(3)]
    assert store.put_pages(hashes, payloads)
    victim = tmp_path / NS.object_key(hashes[1])[:2] / NS.object_key(hashes[1])
    data = bytearray(victim.read_bytes())
    data[500] ^= 0x10
    victim.write_bytes(bytes(data))

    if read_path == "get_pages":
        got = [None if p is None else bytes(p) for p in store.get_pages(hashes)]
    else:
        host = [bytearray(1000) for _ in hashes]
        got = [bytes(h) if ok else None for h, ok in zip(host, store.get_pages_into(hashes, host))]
    assert got == [payloads[0], None, payloads[2]]
    stats = store.stats
    assert (stats.gets, stats.hits, stats.misses, stats.corrupt, stats.errors) == (3, 2, 1, 1, 0)
    # The corrupt object was removed, so the prefix query no longer counts it and a rewrite heals it.
    assert store.exists_prefix(hashes) == 1
    assert store.put_pages(hashes[1:2], payloads[1:2])
    assert bytes(store.get_pages(hashes[1:2])[0]) == payloads[1]


def test_read_into_large_objects(tmp_path: Path) -> None:
    # Pages of the real size go through preadv into a host buffer, bit for bit.
    store = VerifiedStore(FileBackend(tmp_path), NS, payload_bytes=64 * 23040)
    hashes = page_hashes(range(12), 4)
    payloads = [os.urandom(64 * 23040) for _ in hashes]
    assert store.put_pages(hashes, payloads)
    host = bytearray(3 * 64 * 23040)
    pages = [memoryview(host)[i * 64 * 23040 : (i + 1) * 64 * 23040] for i in range(3)]
    assert store.get_pages_into(hashes, pages) == [True] * 3
    assert bytes(host) == b"".join(payloads)


def test_object_moved_to_another_key_is_corrupt(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path)
    store = VerifiedStore(backend, NS)
    a, b = page_hashes(range(8), 4)
    store.put_pages([a], [b"page a"])
    backend.put(NS.object_key(b), backend.get(NS.object_key(a)))  # e.g. a buggy copy or rename
    assert store.get_pages([a, b])[1] is None
    assert store.stats.corrupt == 1


def test_unusable_storage(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageUnavailable):
        FileBackend(blocker / "store")  # a path under a regular file cannot be created
    with pytest.raises(UserError):
        opened("file", dir=str(blocker / "store"))
    backend = FileBackend(tmp_path / "store")
    store = VerifiedStore(backend, NS)
    hashes = page_hashes(range(4), 4)
    key = NS.object_key(hashes[0])
    # A regular file where the fan-out directory belongs makes the write fail (even for root, unlike
    # permissions): counted as an outage and reported as False, never raised.
    (tmp_path / "store" / key[:2]).write_bytes(b"")
    assert store.put_pages(hashes, [b"x"]) is False
    assert store.get_pages(hashes) == [None]
    assert (store.stats.errors, store.stats.misses) == (2, 1)


def test_default_storage_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_storage_dir() == tmp_path / "hicache" / "storage"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_storage_dir() == tmp_path / "home" / ".cache" / "hicache" / "storage"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_storage_dir() == tmp_path / "home" / ".cache" / "hicache" / "storage"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    backend = opened("file")
    assert isinstance(backend, FileBackend) and backend.root == tmp_path / "hicache" / "storage"
    assert not backend.fsync and opened("file", backend_extra_config='{"fsync": true}').fsync


def test_clear_leaves_other_files_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "long_directory").mkdir()
    backend = FileBackend(tmp_path)
    backend.put("ab" + "0" * 62, b"x")
    backend.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long_directory", "notes.txt"]
