"""UnifiedStore on the file backend and a real redis-server: a page written by the ranks of one
topology is read by the ranks of another, each reading exactly its spans (the bytes-read metric), and
a missing or corrupt span is a counted miss of the whole page."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.storage import FileBackend, RedisBackend, StorageBackend, UnifiedStore, page_hashes
from hicache.storage import unified as u
from hicache.storage.spans import prefix_size

PAGE = 4
ITEM = 2
GEO = u.KVGeometry(num_layers=4, num_kv_heads=4, head_dim=8)
GRID = u.Grid(GEO, layer_partition=2, head_partition=2)
NS = u.UnifiedNamespace("m", "bfloat16", PAGE, GRID)


@pytest.fixture(params=["file", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    if request.param == "file":
        b: StorageBackend = FileBackend(tmp_path / "store")
    else:
        b = RedisBackend(request.getfixturevalue("redis_server").url)
    with b:
        yield b


def logical_page(seed: int) -> dict[tuple[int, int], bytes]:
    """(layer, head group) -> that cell-layer's bytes, as every topology must see them."""
    lb = GRID.layer_bytes(PAGE, ITEM)
    return {(layer, g): bytes([(seed * 31 + layer * 7 + g * 3 + i) % 251 for i in range(lb)])
            for layer in range(GEO.num_layers) for g in GRID.groups}  # fmt: skip


def host_page(shard: u.Shard, page: dict) -> bytes:
    """A rank's page_unified host page: its head groups, each its layers in order."""
    groups = [g for g in GRID.groups if set(GRID.group_heads(g)) <= set(shard.heads)]
    return b"".join(page[(layer, g)] for g in groups for layer in shard.layers)


def stores(backend: StorageBackend, tp: int, pp: int) -> list[UnifiedStore]:
    return [UnifiedStore(backend, NS, u.shard_of(GEO, tp, t, pp, p), ITEM) for p in range(pp) for t in range(tp)]


def write(backend: StorageBackend, tp: int, pp: int, hashes: list[bytes], pages: list[dict]) -> None:
    for store in stores(backend, tp, pp):
        assert store.put_pages(hashes, [host_page(store.shard, p) for p in pages])


def test_written_by_tp2_pp2_read_by_tp1_and_tp4(backend: StorageBackend) -> None:
    hashes = page_hashes(range(3 * PAGE), PAGE)
    pages = [logical_page(i) for i in range(3)]
    write(backend, 2, 2, hashes, pages)
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        for store in stores(backend, tp, pp):
            assert store.exists_prefix(hashes) == 3
            outs = [bytearray(store.payload_bytes) for _ in hashes]
            assert store.get_pages_into(hashes, outs) == [True] * 3
            assert [bytes(o) for o in outs] == [host_page(store.shard, p) for p in pages]
            # Exactly the spans: the rank's page bytes, plus each object's header and checksum table.
            stats = store.stats
            assert stats.span_bytes_read == 3 * store.payload_bytes
            assert stats.bytes_read == 3 * store.reads_bytes_per_page
            assert stats.bytes_read == 3 * sum(prefix_size(2) + s.length for s in store.spans)


def test_a_missing_cell_is_a_miss_for_the_page(backend: StorageBackend) -> None:
    hashes = page_hashes(range(2 * PAGE), PAGE)
    pages = [logical_page(i) for i in range(2)]
    write(backend, 2, 2, hashes, pages)
    backend.delete(NS.object_key(hashes[0], GRID.cells[-1]))  # one cell of page 0 (H1, layers 2-3)
    (reader,) = stores(backend, 1, 1)
    assert reader.exists_prefix(hashes) == 0
    assert reader.get_pages_into(hashes, [bytearray(reader.payload_bytes) for _ in hashes]) == [False, True]
    # A rank that does not need the missing cell still hits (the tier's MIN makes it a miss for all).
    tp0 = stores(backend, 2, 1)[0]
    assert tp0.exists_prefix(hashes) == 2


def test_a_corrupt_span_is_a_counted_miss_and_deleted(backend: StorageBackend) -> None:
    hashes = page_hashes(range(PAGE), PAGE)
    write(backend, 1, 1, hashes, [logical_page(0)])
    key = NS.object_key(hashes[0], GRID.cells[1])
    blob = bytearray(backend.get(key))
    blob[-1] ^= 0x40  # the last layer's data
    backend.put(key, bytes(blob))
    (reader,) = stores(backend, 1, 1)
    assert reader.get_pages_into(hashes, [bytearray(reader.payload_bytes)]) == [False]
    stats = reader.stats
    assert (stats.hits, stats.misses, stats.corrupt) == (0, 1, 1)
    assert backend.get(key) is None  # gone, so a writer replaces it


def test_a_sub_range_reader_reads_only_its_layers(backend: StorageBackend) -> None:
    """A reader whose stage cuts a layer range (e.g. an external tool) reads that span only, verified."""
    hashes = page_hashes(range(PAGE), PAGE)
    page = logical_page(5)
    write(backend, 1, 1, hashes, [page])
    shard = u.Shard(range(1, 3), range(0, 4))  # layers 1-2: the end of L0-1 and the start of L2-3
    reader = UnifiedStore(backend, NS, shard, ITEM, writer=False)
    out = bytearray(reader.payload_bytes)
    assert reader.get_pages_into(hashes, [out]) == [True]
    assert bytes(out) == host_page(shard, page)
    assert reader.stats.span_bytes_read == reader.payload_bytes == 4 * GRID.layer_bytes(PAGE, ITEM)


def test_another_namespace_is_a_miss_not_an_error(backend: StorageBackend) -> None:
    hashes = page_hashes(range(PAGE), PAGE)
    write(backend, 1, 1, hashes, [logical_page(0)])
    other = u.UnifiedNamespace("m", "bfloat16", 2 * PAGE, GRID)  # another page size
    reader = UnifiedStore(backend, other, u.shard_of(GEO, 1, 0, 1, 0), ITEM)
    assert reader.exists_prefix(page_hashes(range(2 * PAGE), 2 * PAGE)) == 0
