"""The file store stays bounded: a size cap that removes the least recently used objects, a start-up
sweep of the temp files a crash leaves, and a full disk that turns puts into counted failures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hicache import Engine
from hicache.config import EngineConfig, HiCacheConfig
from hicache.storage import FileBackend, Namespace, VerifiedStore, page_hashes
from hicache.storage.file_capacity import LOW_WATERMARK, STALE_TMP_S
from tests.conversations import make_conversations, run_turns
from tests.page_bytes import stored_page_bytes

NS = Namespace(model="m", kv_dtype="bfloat16", page_size=4, layout="page_rows")
OBJECT = 10_000  # bytes per object in the unit tests


def stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def keys(n: int, salt: int = 0) -> list[str]:
    return [NS.object_key(h) for h in page_hashes([salt] + list(range(4 * n)), 4)][:n]


def test_cap_holds_after_every_put_and_least_recently_used_go_first(tmp_path: Path) -> None:
    cap = 10 * OBJECT
    backend = FileBackend(tmp_path, max_bytes=cap)
    first = keys(10)
    for key in first:
        backend.put(key, b"x" * OBJECT)
        time.sleep(0.002)  # distinct last-use times, whatever the file system's timestamp grain
    assert stored_bytes(tmp_path) == cap  # at the cap, not over it: nothing evicted yet
    assert backend.get(first[0]) is not None  # first[0] is now the most recently used
    time.sleep(0.002)
    for key in keys(3, salt=1):
        backend.put(key, b"y" * OBJECT)
        assert stored_bytes(tmp_path) <= cap
        time.sleep(0.002)
    # One eviction pass went down to the low watermark: the oldest untouched objects went first.
    assert backend.get(first[0]) is not None
    assert backend.get(first[1]) is None and backend.get(first[2]) is None
    objects, nbytes = backend.evictions()
    assert objects >= 3 and nbytes == objects * OBJECT
    assert backend.capacity.stats.eviction_passes >= 1
    assert stored_bytes(tmp_path) <= cap


def test_touched_objects_go_after_untouched_older_ones(tmp_path: Path) -> None:
    """What the storage tier does to a put's ancestors: touched, they are as recent as the put, so the
    cap takes the untouched objects written after them first."""
    backend = FileBackend(tmp_path, max_bytes=10 * OBJECT)
    first = keys(10)
    for key in first:
        backend.put(key, b"x" * OBJECT)
        time.sleep(0.002)
    backend.touch(first[:2] + keys(1, salt=9))  # an absent key is no error: another rank's, or evicted
    time.sleep(0.002)
    backend.put(keys(1, salt=1)[0], b"y" * OBJECT)  # over the cap: down to the low watermark
    assert all(backend.get(key) is not None for key in first[:2])
    assert backend.get(first[2]) is None


def test_an_object_touched_in_the_future_goes_after_every_one_used_before_then(tmp_path: Path) -> None:
    """A retention hint's credit (docs/DESIGN.md, "retention hints"): touched at the end of its retention,
    the oldest object outlives newer plain ones, and a later read does not take the credit back."""
    backend = FileBackend(tmp_path, max_bytes=10 * OBJECT)
    first = keys(10)
    for key in first:
        backend.put(key, b"x" * OBJECT)
        time.sleep(0.002)
    backend.touch(first[:1], at=time.time() + 600)
    assert backend.get(first[0]) is not None  # a read now: used now, but the credit is later and stays
    assert os.stat(backend._path(first[0])).st_mtime > time.time() + 500
    backend.put(keys(1, salt=1)[0], b"y" * OBJECT)  # over the cap: down to the low watermark
    assert backend.get(first[0]) is not None
    assert backend.get(first[1]) is None, "the plain objects used before the credit's end go first"


def test_a_store_over_its_cap_at_start_up_is_brought_under_it(tmp_path: Path) -> None:
    uncapped = FileBackend(tmp_path)
    for key in keys(20):
        uncapped.put(key, b"z" * OBJECT)
    FileBackend(tmp_path, max_bytes=10 * OBJECT)
    assert stored_bytes(tmp_path) <= int(10 * OBJECT * LOW_WATERMARK)


def test_evictions_reach_the_store_stats(tmp_path: Path) -> None:
    store = VerifiedStore(FileBackend(tmp_path, max_bytes=5 * 200), NS)
    hashes = page_hashes(range(4 * 20), 4)
    assert store.put_pages(hashes, [bytes([i]) * 100 for i in range(20)])
    stats = store.stats
    assert stats.evicted_objects > 0 and stats.evicted_bytes > 0
    assert stats.puts == 20 and stats.errors == 0


def test_stale_temp_files_are_swept_at_start_up_and_fresh_ones_kept(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path)
    key = keys(1)[0]
    backend.put(key, b"kept")
    directory = tmp_path / key[:2]
    stale, fresh = directory / f".{key}.aaaa.tmp", directory / f".{key}.bbbb.tmp"
    stale.write_bytes(b"left by a crash")
    fresh.write_bytes(b"a writer at work")
    old = time.time() - 2 * STALE_TMP_S
    os.utime(stale, (old, old))
    restarted = FileBackend(tmp_path)
    assert not stale.exists() and fresh.exists()
    assert restarted.capacity.stats.swept_tmp_files == 1
    assert restarted.get(key) == b"kept"


@pytest.mark.slow
def test_a_full_disk_makes_puts_counted_failures_not_crashes(tmp_path: Path) -> None:
    """A real write failure: the process's file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored so the
    write returns EFBIG as a full disk returns ENOSPC) stops the write part way."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        from hicache.storage import FileBackend, Namespace, VerifiedStore, page_hashes
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        ns = Namespace(model="m", kv_dtype="bfloat16", page_size=4, layout="page_rows")
        store = VerifiedStore(FileBackend({str(tmp_path)!r}), ns)
        ok = store.put_pages(page_hashes(range(8), 4), [b"a" * 100, b"b" * 100_000])
        stats = store.stats
        print(ok, stats.puts, stats.errors)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ok, puts, errors = proc.stdout.split()
    assert ok == "False" and int(errors) >= 1
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*")), "the torn temp file stayed"


@pytest.mark.slow
@pytest.mark.dtype_sensitive  # a store cap or byte count in the dtype `--dtype auto` takes here
def test_a_capped_store_serves_equal_answers_and_stays_under_its_cap(tmp_path: Path) -> None:
    convs = make_conversations(num_groups=2, per_group=2, system_len=300, question_len=40)
    with Engine(model="tiny", disable_radix_cache=True) as off:
        reference = [[r.token_ids for r in turn] for turn in run_turns(off, convs, 3, 16)]
    # Room for 6 pages' objects of the ~80 the conversations store, in the dtype the engine runs here
    cap = 6 * stored_page_bytes(EngineConfig(model="tiny"))
    store = str(tmp_path / "store")
    cfg = HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=store,
        hicache_storage_max_bytes=cap,
        hicache_storage_prefetch_threshold=64,
    )
    for _ in range(2):  # the second engine reads what the first left under the cap
        with Engine(model="tiny", max_total_tokens=1024, hicache=cfg) as engine:
            turns = run_turns(engine, convs, 3, 16)
            assert [[r.token_ids for r in turn] for turn in turns] == reference
            stats = engine.cache_stats().storage.store
            assert engine.flush_cache() and engine.leak_report() == []
        assert stored_bytes(Path(store)) <= cap
    assert stats.evicted_objects > 0 and stats.corrupt == 0
