"""The StorageBackend contract, checked the same way on every backend (and on the test fake, so tests
that rely on the fake test against the real semantics)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache.storage import StorageBackend, registry
from tests.storage.conftest import opened
from tests.storage.fakes import DictBackend
from tests.storage.redis_server import RedisServer, RedisServerError


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    try:
        server = RedisServer(tmp_path_factory.mktemp("redis"))
    except RedisServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server


# How the contract opens each registered backend (its flags): a backend registered without an entry
# here fails test_every_registered_backend_is_checked.
FLAGS: dict[str, Callable[[pytest.FixtureRequest, Path], dict[str, object]]] = {
    "file": lambda request, tmp_path: {"dir": str(tmp_path / "store")},
    "redis": lambda request, tmp_path: {"url": request.getfixturevalue("shared_redis").url},
}


@pytest.fixture(params=["dict", *registry.BACKENDS])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    if request.param == "dict":
        b: StorageBackend = DictBackend()
    else:
        b = opened(request.param, **FLAGS[request.param](request, tmp_path))
    b.clear()
    with b:
        yield b


def test_every_registered_backend_is_checked() -> None:
    assert set(FLAGS) == set(registry.BACKENDS)


def keys(n: int) -> list[str]:
    return [f"{i:064x}_0123456789abcdef" for i in range(n)]


def test_get_put_delete(backend: StorageBackend) -> None:
    k = keys(2)
    assert backend.get(k[0]) is None
    backend.put(k[0], b"hello")
    assert backend.get(k[0]) == b"hello"
    backend.put(k[0], memoryview(b"world"))  # any bytes-like value
    assert backend.get(k[0]) == b"world"
    backend.put(k[1], b"")
    assert backend.get(k[1]) == b""  # empty is not absent
    backend.delete(k[0])
    backend.delete(k[0])  # deleting an absent key is fine
    assert backend.get(k[0]) is None


def test_batches_keep_order(backend: StorageBackend) -> None:
    k = keys(6)
    backend.batch_put([(k[i], bytes([i]) * (i + 1)) for i in (0, 1, 3, 4)])
    assert backend.batch_get(k) == [b"\x00", b"\x01\x01", None, b"\x03" * 4, b"\x04" * 5, None]
    assert backend.batch_get([]) == []
    backend.batch_put([])


def test_exists_prefix_stops_at_first_missing(backend: StorageBackend) -> None:
    k = keys(600)  # more than one Redis EXISTS chunk
    assert backend.exists_prefix(k) == 0
    assert backend.exists_prefix([]) == 0
    backend.batch_put([(key, b"x") for key in k[:300]] + [(key, b"x") for key in k[301:]])
    assert backend.exists_prefix(k) == 300
    assert backend.exists_prefix(k[:300]) == 300
    assert backend.exists_prefix(k[301:]) == 299
    backend.put(k[300], b"x")
    assert backend.exists_prefix(k) == 600


def test_get_range(backend: StorageBackend) -> None:
    k = keys(2)
    backend.put(k[0], bytes(range(100)))
    assert backend.get_range(k[0], 10, 5) == bytes(range(10, 15))
    assert backend.get_range(k[0], 0, 100) == bytes(range(100))
    assert backend.get_range(k[0], 95, 10) == bytes(range(95, 100))  # short at the end
    assert backend.get_range(k[0], 200, 10) == b""
    assert backend.get_range(k[0], 0, 0) == b""
    assert backend.get_range(k[1], 0, 10) is None
    assert backend.get_range(k[1], 0, 0) is None
    with pytest.raises(ValueError):
        backend.get_range(k[0], -1, 5)


def test_clear(backend: StorageBackend) -> None:
    k = keys(20)
    backend.batch_put([(key, b"x") for key in k])
    backend.clear()
    assert backend.batch_get(k) == [None] * 20


@pytest.mark.parametrize(
    "bad", ["", "a", "../etc", "a/b", "..", "ab\x00cd", "ab cd", "ab.cd", "abc\n", "é" * 4, "x" * 201, "C:\\x"]
)
def test_invalid_keys_are_rejected_before_io(backend: StorageBackend, bad: str) -> None:
    for call in (
        lambda: backend.get(bad),
        lambda: backend.put(bad, b"x"),
        lambda: backend.batch_get([keys(1)[0], bad]),
        lambda: backend.batch_put([(keys(1)[0], b"x"), (bad, b"x")]),
        lambda: backend.exists_prefix([bad]),
        lambda: backend.get_range(bad, 0, 1),
        lambda: backend.delete(bad),
    ):
        with pytest.raises(ValueError):
            call()
    assert backend.get(keys(1)[0]) is None  # the valid half of a rejected batch was not written


def test_blob_in_parts_is_one_object(backend: StorageBackend) -> None:
    k = keys(3)
    backend.put(k[0], (b"head", memoryview(b"-and-"), bytearray(b"tail")))
    backend.batch_put([(k[1], (b"x" * 64, b"y" * 100_000)), (k[2], b"single")])
    assert backend.batch_get(k) == [b"head-and-tail", b"x" * 64 + b"y" * 100_000, b"single"]


def test_batch_get_into_scatters_and_reports_size(backend: StorageBackend) -> None:
    k = keys(4)
    backend.batch_put([(k[0], bytes(range(100))), (k[1], b"short"), (k[3], bytes(range(200)))])
    bufs = [(memoryview(bytearray(10)), memoryview(bytearray(90))) for _ in k]
    sizes = backend.batch_get_into(k, bufs)
    assert sizes == [100, 5, None, 200]
    assert bytes(bufs[0][0]) + bytes(bufs[0][1]) == bytes(range(100))
    assert bytes(bufs[1][0]) == b"short" + bytes(5) and bytes(bufs[1][1]) == bytes(90)  # rest untouched
    assert bytes(bufs[2][0]) == bytes(10)
    assert bytes(bufs[3][0]) + bytes(bufs[3][1]) == bytes(range(100))  # only what fits is read
    assert backend.batch_get_into([], []) == []
    with pytest.raises(ValueError):
        backend.batch_get_into(k, bufs[:1])


def test_positioned_writes_and_ranged_reads(backend: StorageBackend) -> None:
    """batch_put_ranges lays parts out at their offsets (gaps zero); batch_read_ranges reads exactly
    the ranges asked for, says how much it got (short past the end) and None for an absent object."""
    k = keys(2)
    backend.batch_put_ranges([(k[0], 12, [(0, b"ab"), (8, memoryview(b"wxyz"))])])
    assert backend.get(k[0]) == b"ab\x00\x00\x00\x00\x00\x00wxyz"
    head, tail, past = bytearray(2), bytearray(3), bytearray(4)
    got = backend.batch_read_ranges(
        [(k[0], [(0, memoryview(head)), (9, memoryview(tail))]), (k[1], [(0, memoryview(bytearray(1)))]),
         (k[0], [(10, memoryview(past))])]
    )  # fmt: skip
    assert got == [5, None, 2]
    assert (bytes(head), bytes(tail), bytes(past[:2])) == (b"ab", b"xyz", b"yz")
    backend.batch_put_ranges([(k[0], 3, [(0, b"new")])])  # replaces the whole object
    assert backend.get(k[0]) == b"new"
