"""One external store shared by every compatible topology (--hicache-storage-key-scheme unified): a store
written by TP2xPP2 is read after a restart by TP1xPP1, TP2xPP1 and TP1xPP2, which serve at least 90 %
of the shared prefix from storage and generate what the single-rank cache-off run generates: `tiny` (K/V
heads cut into head groups) on the file backend and `tiny-mla` (one latent per layer range) on Redis, each
store written once (module-scoped). Each model and each backend runs once: what a backend does with a
layout's objects is names and byte ranges, which tests/storage/test_backend_contract.py checks for both.

In the default dtype (bfloat16 on a CPU with native bf16): every TP size computes the KV's bits
(hicache/model/kernels/tp_groups.py), and the storage layout is exact, so what a reader restores is byte for
byte what it would have computed itself. tests/parallel/test_tp_invariance.py checks the log-probabilities
too, in bfloat16 and float32.
"""

from __future__ import annotations

import functools

import pytest

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig, ParallelConfig
from hicache.errors import UserError
from tests.storage.redis_server import RedisServer

PAGE = 16
SHARED = 320  # tokens of system prompt every request shares
PROMPTS = [[32 + (i * 7 + c * (i > SHARED) * 13) % 90 for i in range(SHARED + 40)] for c in range(3)]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
GRID = dict(hicache_storage_layer_partition=2, hicache_storage_head_partition=1)
STORES = [("tiny", "file"), ("tiny-mla", "redis")]  # (model, backend)
READERS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) after a TP2xPP2 writer


def tiers(backend: str, where: str, **kw) -> HiCacheConfig:
    store = {"hicache_storage_dir": where} if backend == "file" else {"hicache_storage_url": where}
    return HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_storage_backend=backend,
        hicache_storage_prefetch_threshold=64,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_key_scheme="unified",
        **store,
        **{**GRID, **kw},
    )


def engine(
    model: str, backend: str, where: str, tp: int = 1, pp: int = 1, page_size: int = PAGE, cp: int = 1, **kw
) -> Engine:
    return Engine(model=model, page_size=page_size, hicache=tiers(backend, where, **kw),
                  parallel=ParallelConfig(tp_size=tp, pp_size=pp, cp_size=cp))  # fmt: skip


@functools.cache
def reference(model: str) -> list[list[int]]:
    with Engine(model=model, disable_radix_cache=True) as e:
        return [r.token_ids for r in e.generate(PROMPTS, PARAMS)]


def write(model: str, backend: str, where: str, tp: int = 2, pp: int = 2, cp: int = 1) -> None:
    with engine(model, backend, where, tp=tp, pp=pp, cp=cp) as e:
        results = e.generate(PROMPTS, PARAMS)
        assert all(r.error is None for r in results)
        assert e.flush_cache()  # the puts are done before the writer goes
        assert e.cache_stats().storage.store.puts > 0


def read(model: str, backend: str, where: str, tp: int, pp: int, want: list[list[int]], cp: int = 1) -> None:
    with engine(model, backend, where, tp=tp, pp=pp, cp=cp) as e:
        results = e.generate(PROMPTS, PARAMS)
        assert [r.error for r in results] == [None] * len(PROMPTS)
        assert [r.token_ids for r in results] == want
        shared = SHARED // PAGE * PAGE
        tiers = [r.cached_tokens_by_tier for r in results]
        # Nothing was in memory after the restart: storage serves the shared prefix (once; a request
        # admitted after it was inserted finds it in memory), and every request reuses it.
        assert sum(t["storage"] for t in tiers) >= 0.9 * shared, tiers
        assert all(sum(t.values()) >= 0.9 * shared for t in tiers), tiers
        stats = e.cache_stats().storage.store
        assert stats.corrupt == 0 and stats.span_bytes_read > 0


@pytest.fixture(scope="module")
def redis_store(tmp_path_factory):
    """One server for the module's stores (each model its own namespace, so they share it)."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(scope="module", params=STORES, ids="-".join)
def tp2_pp2_store(request, tmp_path_factory):
    """A store written once per model and backend by TP2xPP2, for every reader topology. tiny-mla:
    the latent is the same for every head, one object per layer range, pages sharded over the
    writer's TP ranks."""
    model, backend = request.param
    where = str(tmp_path_factory.mktemp("unified")) if backend == "file" else request.getfixturevalue("redis_store")
    write(model, backend, where)
    return model, backend, where


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", READERS)
def test_written_by_tp2_pp2_read_by_another_topology(tp2_pp2_store, tp, pp):
    model, backend, where = tp2_pp2_store
    read(model, backend, where, tp, pp, reference(model))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("writer,reader", [(2, 1), (1, 2)])
def test_page_sharded_cp_writers_and_readers_of_another_cp_size(tmp_path, writer, reader):
    """Each CP rank writes the objects of the pages it owns; a reader of another CP size finds every
    page's objects by name (names say what an object holds, never who wrote it) and loads its own."""
    write("tiny", "file", str(tmp_path), tp=1, pp=1, cp=writer)
    read("tiny", "file", str(tmp_path), 1, 1, reference("tiny"), cp=reader)


def test_a_misaligned_grid_is_refused_at_start_up(tmp_path):
    with pytest.raises(UserError, match=r"pipeline stage ends at layer 2, inside the storage layer range L0-3"):
        engine("tiny", "file", str(tmp_path), pp=2, hicache_storage_layer_partition=4)
    with pytest.raises(UserError, match=r"KV heads end at head 1, inside head group H0 = heads 0-1"):
        engine("tiny", "file", str(tmp_path), tp=2, hicache_storage_head_partition=2)


@pytest.mark.slow
def test_another_page_size_gets_no_hits(tmp_path):
    where = str(tmp_path)
    write("tiny", "file", where, tp=1, pp=1)
    with engine("tiny", "file", where, page_size=2 * PAGE) as e:
        results = e.generate(PROMPTS[:1], PARAMS)
        assert results[0].cached_tokens_by_tier["storage"] == 0
        assert e.cache_stats().storage.store.hits == 0


def test_a_corrupt_span_is_a_counted_miss_and_outputs_stay_equal(tmp_path):
    with engine("tiny", "file", str(tmp_path)) as e:
        e.generate(PROMPTS[:1], PARAMS)
        assert e.flush_cache()
    objects = sorted(p for p in tmp_path.rglob("*_L2-3_H1") if p.is_file())
    assert objects
    with open(objects[0], "r+b") as f:  # flip a byte of the last layer of one object
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0x10]))
    with engine("tiny", "file", str(tmp_path)) as e:
        results = e.generate(PROMPTS[:1], PARAMS)
        assert [r.token_ids for r in results] == reference("tiny")[:1]
        stats = e.cache_stats().storage.store
        assert stats.corrupt == 1 and stats.misses >= 1
