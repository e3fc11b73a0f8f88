"""Storage tier throughput against raw baselines measured in the same run (not a test).

For KV-page-sized objects (smollm2 bf16: 30 layers x 2 x 3 heads x 64 dims x 2 B = 23,040 B per token;
a 16-token page is 368,640 B, a 64-token page 1,474,560 B) it measures:

- codec encode / decode vs a plain memcpy of the same bytes (and CRC-32 alone, the checksum's limit);
- FileBackend batch_put / batch_get and VerifiedStore put_pages / get_pages vs raw open().write() /
  read() of the same sizes in the same directory (page cache both ways); get_pages_into (preadv into
  a reused host buffer) vs raw readinto of the same buffer; put with fsync vs raw write + fsync;
- RedisBackend put / get (one call per object) vs raw redis-py SET / GET, and batch_put / batch_get
  (pipelined) vs a raw pipeline of SET / MGET, plus VerifiedStore (get_pages, get_pages_into) on top;
- chained page hashing of a 1M-token prompt at page 16 vs one SHA-256 pass over the same bytes.

Everything moves batches of 64 pages whose results stay alive until the batch is done, as a prefetch
would, for the measured path and its baseline alike: on this VM, faulting in fresh memory for results
costs more than copying into warm memory, so the allocation pattern must match to compare fairly.
Each figure is the best of --reps runs (least disturbed by the other tenants of a small VM). Run:

    .venv/bin/python benchmarks/storage_bench.py [--dir DIR] [--total-mib 256] [--redis-url URL]

Without --redis-url it starts a private redis-server (tests/storage/redis_server.py) for the run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis

# Run as a script from anywhere: the package and the test helper live at the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.storage import FileBackend, Namespace, RedisBackend, VerifiedStore, decode, encode, page_hashes  # noqa: E402
from tests.storage.redis_server import RedisServer  # noqa: E402

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2
PAGE_SIZES = (16, 64)
BATCH = 64  # pages per batched call, about what one prefetch step of a long prompt moves


@dataclass
class Row:
    size: int
    op: str
    gbps: float
    baseline: str
    baseline_gbps: float


def best_time(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def batches(n: int) -> list[range]:
    return [range(i, min(i + BATCH, n)) for i in range(0, n, BATCH)]


def bench_codec(size: int, payloads: list[bytes], reps: int) -> list[Row]:
    # Batch-shaped like the controller: a batch's results stay alive until the batch is done, so the
    # allocator's reuse (or page faults on fresh memory) is the same for the codec and its baseline.
    ns = Namespace(model="bench", kv_dtype="bfloat16", page_size=size // BYTES_PER_TOKEN, layout="page_rows")
    hashes = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(len(payloads))]
    chunks = batches(len(payloads))
    total = size * len(payloads)
    dst = np.empty(size, dtype=np.uint8)
    t_copy = best_time(lambda: [[bytearray(payloads[i]) for i in c] for c in chunks], reps)
    t_copyto = best_time(lambda: [np.copyto(dst, np.frombuffer(p, dtype=np.uint8)) for p in payloads], reps)
    t_crc = best_time(lambda: [zlib.crc32(p) for p in payloads], reps)
    blobs = [encode(h, ns.digest, p) for h, p in zip(hashes, payloads)]
    t_enc = best_time(lambda: [[encode(hashes[i], ns.digest, payloads[i]) for i in c] for c in chunks], reps)
    t_dec = best_time(lambda: [[decode(blobs[i], hashes[i], ns.digest) for i in c] for c in chunks], reps)
    memcpy = gbps(total, t_copyto)
    return [
        Row(size, "copy to new bytearray", gbps(total, t_copy), "memcpy (warm buffer)", memcpy),
        Row(size, "crc32 alone", gbps(total, t_crc), "memcpy (warm buffer)", memcpy),
        Row(size, "codec encode (join, 1 copy+crc)", gbps(total, t_enc), "memcpy (warm buffer)", memcpy),
        Row(size, "codec decode (crc, zero-copy)", gbps(total, t_dec), "memcpy (warm buffer)", memcpy),
    ]


def raw_readinto(path: Path, buf: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        f.readinto(buf)


def bench_file(root: Path, size: int, payloads: list[bytes], reps: int, fsync_objects: int) -> list[Row]:
    ns = Namespace(model="bench", kv_dtype="bfloat16", page_size=size // BYTES_PER_TOKEN, layout="page_rows")
    n = len(payloads)
    hashes = page_hashes(np.arange(n * ns.page_size) % 49152, ns.page_size)
    blobs = [encode(h, ns.digest, p) for h, p in zip(hashes, payloads)]
    keys = [ns.object_key(h) for h in hashes]
    blob_total = sum(len(b) for b in blobs)
    chunks = batches(n)
    raw_dir, store_dir = root / "raw", root / "store"
    raw_paths = [raw_dir / k for k in keys]

    def reset() -> None:
        shutil.rmtree(raw_dir, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)  # the backend recreates its directories on demand
        raw_dir.mkdir(parents=True)

    def raw_write(count: int = n, fsync: bool = False) -> None:
        for i in range(count):
            with open(raw_paths[i], "wb") as f:
                f.write(blobs[i])
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

    def raw_read_batch(c: range) -> list[bytes]:
        out = []
        for i in c:
            with open(raw_paths[i], "rb") as f:
                out.append(f.read())
        return out

    backend = FileBackend(store_dir)
    store = VerifiedStore(backend, ns)
    t_raw_w = best_time(raw_write, reps, setup=reset)
    t_put = best_time(lambda: [backend.batch_put([(keys[i], blobs[i]) for i in c]) for c in chunks], reps, setup=reset)
    t_sput = best_time(
        lambda: [store.put_pages([hashes[i] for i in c], [payloads[i] for i in c]) for c in chunks], reps, setup=reset
    )
    raw_write()  # both sides populated and in the page cache for the reads
    t_raw_r = best_time(lambda: [raw_read_batch(c) for c in chunks], reps)
    t_get = best_time(lambda: [backend.batch_get([keys[i] for i in c]) for c in chunks], reps)
    t_sget = best_time(lambda: [store.get_pages([hashes[i] for i in c]) for c in chunks], reps)
    host = [memoryview(bytearray(size)) for _ in range(BATCH)]  # a warm "host pool" batch, reused
    t_raw_into = best_time(lambda: [raw_readinto(raw_paths[i], host[j]) for c in chunks for j, i in enumerate(c)], reps)
    t_sinto = best_time(
        lambda: [store.get_pages_into([hashes[i] for i in c], host[: len(c)]) for c in chunks], reps
    )
    g = lambda t: gbps(blob_total, t)  # noqa: E731
    rows = [
        Row(size, f"file batch_put ({BATCH}/call)", g(t_put), "raw write", g(t_raw_w)),
        Row(size, "file VerifiedStore.put_pages", g(t_sput), "raw write", g(t_raw_w)),
        Row(size, f"file batch_get ({BATCH}/call)", g(t_get), "raw read", g(t_raw_r)),
        Row(size, "file VerifiedStore.get_pages", g(t_sget), "raw read", g(t_raw_r)),
        Row(size, "file VerifiedStore.get_pages_into", g(t_sinto), "raw readinto (warm)", g(t_raw_into)),
    ]
    if fsync_objects:
        m = min(fsync_objects, n)
        synced = FileBackend(store_dir, fsync=True)
        t_raw_fs = best_time(lambda: raw_write(m, fsync=True), reps, setup=reset)
        t_put_fs = best_time(lambda: [synced.put(keys[i], blobs[i]) for i in range(m)], reps, setup=reset)
        nbytes = len(blobs[0]) * m
        rows.append(
            Row(size, "file put, fsync=True", gbps(nbytes, t_put_fs), "raw write + fsync", gbps(nbytes, t_raw_fs))
        )
    reset()
    return rows


def bench_redis(url: str, size: int, payloads: list[bytes], reps: int) -> list[Row]:
    ns = Namespace(model="bench", kv_dtype="bfloat16", page_size=size // BYTES_PER_TOKEN, layout="page_rows")
    n = len(payloads)
    hashes = page_hashes(np.arange(n * ns.page_size) % 49152, ns.page_size)
    blobs = [encode(h, ns.digest, p) for h, p in zip(hashes, payloads)]
    keys = [ns.object_key(h) for h in hashes]
    names = ["hicache:" + k for k in keys]  # the raw client moves the same names and bytes as the backend
    blob_total = sum(len(b) for b in blobs)
    chunks = batches(n)
    raw = redis.Redis.from_url(url)
    backend = RedisBackend(url)
    store = VerifiedStore(backend, ns)

    def flush() -> None:
        raw.flushdb()

    def raw_set_one() -> None:
        for name, blob in zip(names, blobs):
            raw.set(name, blob)

    def put_one() -> None:
        for key, blob in zip(keys, blobs):
            backend.put(key, blob)

    def raw_pipeline_set() -> None:
        for c in chunks:
            pipe = raw.pipeline(transaction=False)
            for i in c:
                pipe.set(names[i], blobs[i])
            pipe.execute()

    def raw_get_one() -> None:
        for name in names:
            raw.get(name)

    def get_one() -> None:
        for key in keys:
            backend.get(key)

    t_raw_set = best_time(raw_set_one, reps, setup=flush)
    t_put = best_time(put_one, reps, setup=flush)
    t_raw_pset = best_time(raw_pipeline_set, reps, setup=flush)
    t_bput = best_time(lambda: [backend.batch_put([(keys[i], blobs[i]) for i in c]) for c in chunks], reps, setup=flush)
    t_sput = best_time(
        lambda: [store.put_pages([hashes[i] for i in c], [payloads[i] for i in c]) for c in chunks], reps, setup=flush
    )
    t_raw_get = best_time(raw_get_one, reps)
    t_get = best_time(get_one, reps)
    t_raw_mget = best_time(lambda: [raw.mget([names[i] for i in c]) for c in chunks], reps)
    t_bget = best_time(lambda: [backend.batch_get([keys[i] for i in c]) for c in chunks], reps)
    t_sget = best_time(lambda: [store.get_pages([hashes[i] for i in c]) for c in chunks], reps)
    host = [memoryview(bytearray(size)) for _ in range(BATCH)]
    t_sinto = best_time(
        lambda: [store.get_pages_into([hashes[i] for i in c], host[: len(c)]) for c in chunks], reps
    )
    flush()
    raw.close()
    backend.close()
    g = lambda t: gbps(blob_total, t)  # noqa: E731
    return [
        Row(size, "redis put (1/call)", g(t_put), "raw SET", g(t_raw_set)),
        Row(size, f"redis batch_put ({BATCH}/call)", g(t_bput), "raw pipelined SET", g(t_raw_pset)),
        Row(size, "redis VerifiedStore.put_pages", g(t_sput), "raw pipelined SET", g(t_raw_pset)),
        Row(size, "redis get (1/call)", g(t_get), "raw GET", g(t_raw_get)),
        Row(size, f"redis batch_get ({BATCH}/call)", g(t_bget), "raw MGET", g(t_raw_mget)),
        Row(size, "redis VerifiedStore.get_pages", g(t_sget), "raw MGET", g(t_raw_mget)),
        Row(size, "redis VerifiedStore.get_pages_into", g(t_sinto), "raw MGET", g(t_raw_mget)),
    ]


def bench_hashing(reps: int) -> list[str]:
    tokens_np = np.random.default_rng(0).integers(0, 49152, 1 << 20)
    tokens_list = tokens_np.tolist()
    packed = tokens_np.astype("<u4").tobytes()
    t_list = best_time(lambda: page_hashes(tokens_list, 16), reps)
    t_np = best_time(lambda: page_hashes(tokens_np, 16), reps)
    t_sha = best_time(lambda: hashlib.sha256(packed).digest(), reps)
    n = len(tokens_list)
    return [
        f"page_hashes, 1M tokens (list[int]), page 16: {t_list * 1e3:7.1f} ms  {n / t_list / 1e6:6.1f} M tokens/s",
        f"page_hashes, 1M tokens (np.int64),  page 16: {t_np * 1e3:7.1f} ms  {n / t_np / 1e6:6.1f} M tokens/s",
        f"baseline: one SHA-256 over the same 4 MiB:    {t_sha * 1e3:7.1f} ms  {n / t_sha / 1e6:6.1f} M tokens/s"
        f"  (chain overhead x{t_np / t_sha:.1f}: 65,536 digests of 96 B input each)",
    ]


def print_table(rows: list[Row]) -> None:
    print(f"{'object B':>10}  {'operation':<36} {'GB/s':>7}   {'baseline':<22} {'GB/s':>7}  {'ratio':>6}")
    for r in rows:
        print(
            f"{r.size:>10,}  {r.op:<36} {r.gbps:7.2f}   {r.baseline:<22} {r.baseline_gbps:7.2f}  "
            f"{r.gbps / r.baseline_gbps:6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fsync-mib", type=int, default=64, help="bytes per fsync measurement (0: skip)")
    parser.add_argument("--redis-url", default=None, help="use this server (its database is FLUSHed!)")
    parser.add_argument("--no-redis", action="store_true")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="hicache-bench-", dir=args.dir))
    server = None
    if not args.no_redis and args.redis_url is None:
        (scratch / "redis").mkdir()
        server = RedisServer(scratch / "redis")
        server.start()
    url = args.redis_url or (server.url if server else "")
    rows: list[Row] = []
    try:
        for page in PAGE_SIZES:
            size = page * BYTES_PER_TOKEN
            n = max(BATCH, args.total_mib * 2**20 // size)
            rng = np.random.default_rng(page)
            payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
            rows += bench_codec(size, payloads, args.reps)
            fsync_objects = args.fsync_mib * 2**20 // size
            rows += bench_file(scratch / "files", size, payloads, args.reps, fsync_objects)
            if url:
                rows += bench_redis(url, size, payloads, args.reps)
        hashing = bench_hashing(args.reps)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"storage bench: {args.total_mib} MiB per measurement, best of {args.reps}, batches of {BATCH} pages")
    print_table(rows)
    print()
    for line in hashing:
        print(line)


if __name__ == "__main__":
    main()
