"""Batched existence (one directory pass, one Redis command per chunk) answers what asking key by key
answers, whatever mix of present, missing, corrupt and half-written objects a store holds."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.storage import FileBackend, RedisBackend, StorageBackend
from hicache.storage import file_backend as file_backend_module
from tests.storage.redis_server import RedisServer

PRESENT, MISSING, CORRUPT, HALF_WRITTEN = "present", "missing", "corrupt", "half_written"

# Keys share a few fan-out directories, so a query asks several keys of one directory, and a drawn
# number of other objects beside them decides whether the file store lists a directory or stats keys.
FANOUTS = st.sampled_from(["00", "0a", "ff"])
KEY = st.builds(lambda fan, n: f"{fan}{n:062x}_0123456789abcdef", FANOUTS, st.integers(0, 40))
STATES = st.sampled_from([PRESENT, MISSING, CORRUPT, HALF_WRITTEN])
STORE = st.lists(st.tuples(KEY, STATES), max_size=30, unique_by=lambda item: item[0])
EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def populate(backend: StorageBackend, store: list[tuple[str, str]], others: int) -> None:
    backend.clear()
    for key, state in store:
        if state == PRESENT:
            backend.put(key, b"\x01" * 64)
        elif state == CORRUPT:
            backend.put(key, b"not an envelope")  # existence is not validity: it still counts
        elif state == HALF_WRITTEN and isinstance(backend, FileBackend):  # a put's temp file, not yet renamed
            directory = os.path.join(backend.root, key[:2])
            os.makedirs(directory, exist_ok=True)
            Path(directory, f".{key}.0123.tmp").write_bytes(b"\x01" * 64)
    for i in range(others):
        backend.put(f"0a{i:062x}_fedcba9876543210", b"x")


def per_key(backend: StorageBackend, keys: list[str]) -> int:
    """The leading keys whose object a reader gets, asked one at a time."""
    return next((i for i, key in enumerate(keys) if backend.get(key) is None), len(keys))


@pytest.fixture(params=["list", "stat", "measured"])
def file_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FileBackend]:
    """A file store that lists every directory it asks, stats every key, or chooses as it does in use."""
    if request.param != "measured":
        monkeypatch.setattr(file_backend_module, "_LIST_BYTES_PER_KEY", 1 << 40 if request.param == "list" else -1)
    with FileBackend(tmp_path / "store") as backend:
        yield backend


@EXAMPLES
@given(STORE, st.lists(KEY, max_size=30), st.integers(0, 80))
def test_file_store_batched_equals_per_key(file_store: FileBackend, store, asked: list[str], others: int) -> None:
    populate(file_store, store, others)
    keys = list(dict.fromkeys([key for key, _ in store] + asked))  # the stored ones first: long prefixes
    assert file_store.exists_prefix(keys) == per_key(file_store, keys)
    assert file_store.exists_prefix(keys[::-1]) == per_key(file_store, keys[::-1])


@EXAMPLES
@given(STORE, st.lists(KEY, max_size=30), st.integers(1, 8))
def test_redis_batched_equals_per_key(redis_server: RedisServer, store, asked: list[str], chunk: int) -> None:
    with RedisBackend(redis_server.url, exists_chunk=chunk) as backend:  # small chunks: several commands
        populate(backend, store, 0)
        keys = list(dict.fromkeys([key for key, _ in store] + asked))
        assert backend.exists_prefix(keys) == per_key(backend, keys)
        assert backend.exists_prefix(keys[::-1]) == per_key(backend, keys[::-1])


def test_redis_script_survives_a_restart(redis_server: RedisServer) -> None:
    """A restarted server has forgotten the script: the next query loads it again, not a miss."""
    with RedisBackend(redis_server.url) as backend:
        backend.put("ab_00", b"x")
        assert backend.exists_prefix(["ab_00", "ab_01"]) == 1
        redis_server.stop()
        redis_server.start()
        backend.put("ab_00", b"x")
        assert backend.exists_prefix(["ab_00", "ab_01"]) == 1
