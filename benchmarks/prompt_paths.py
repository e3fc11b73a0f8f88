"""The paths that grow with a prompt, at 128K tokens (8,192 pages of 16), against baselines measured in
the same run (not a test; docs/BENCHMARKS.md, "Prompt-length paths"):

- page keys: `page_hashes` vs the per-page slicing loop it replaced, vs one SHA-256 over the same
  bytes (what hashing the ids costs with no per-page work at all), and vs one SHA-256 over as many
  64-byte blocks as the chain compresses (the physical limit of the chain, parent digests and padding
  included);
- the P/D prompt digest vs the per-token encoding it replaced, and vs BLAKE2b over the packed bytes;
- existence of 8,192 pages: the file store (a temp dir holding exactly those pages, then the same with
  many other objects beside them) vs a stat per key, the old path; Redis (a private redis-server) vs the
  pipelined EXISTS per key it replaced, and vs one multi-key EXISTS (a count only: the floor of one
  command carrying every key);
- how many agreements across ranks a prefetch of the 8,192 pages takes, for smollm2's and tiny's pages,
  vs one per 8 pages before;
- a host reservation of 8,192 pages (PageAllocator alloc + free), per page.

    .venv/bin/python benchmarks/prompt_paths.py [--tokens 131072] [--others 131072] [--reps 9]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import best_time, cpu_name  # noqa: E402
from hicache.cache.storage_tier import PREFETCH_BATCH_BYTES, PREFETCH_FIRST_BATCH_PAGES, read_batches  # noqa: E402
from hicache.disagg.wire import prompt_digest  # noqa: E402
from hicache.mem.allocator import PageAllocator  # noqa: E402
from hicache.storage import FileBackend, Namespace, RedisBackend, pack_u32, page_hashes  # noqa: E402
from hicache.storage.keys import HASH_BYTES  # noqa: E402
from tests.storage.redis_server import RedisServer  # noqa: E402

PAGE = 16
NS = Namespace("bench-model", "bfloat16", PAGE, "page_rows")
SMOLLM2_PAGE_BYTES = PAGE * 23_040  # 30 layers x 2 x 3 heads x 64 dims x 2 B per token
TINY_PAGE_BYTES = PAGE * 4 * 2 * 2 * 32 * 2  # tiny: 4 layers x K/V x 2 heads x 32 dims x 2 B (bf16) per token


def old_page_hashes(tokens: Sequence[int] | np.ndarray, page_size: int) -> list[bytes]:
    """The loop page_hashes had before: one packed buffer sliced page by page in Python."""
    packed = np.ascontiguousarray(np.asarray(tokens), dtype="<u4").data.cast("B")
    prev, out, page_bytes = bytes(32), [], 4 * page_size
    for start in range(0, len(packed) - page_bytes + 1, page_bytes):
        h = hashlib.sha256(prev)
        h.update(packed[start : start + page_bytes])
        prev = h.digest()
        out.append(prev)
    return out


def old_prompt_digest(prompt: Sequence[int]) -> str:
    """The P/D prompt digest before: each token encoded by a Python call."""
    data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in prompt)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def old_file_exists(backend: FileBackend, keys: list[str]) -> int:
    """The file store's exists_prefix before: a stat per key."""
    paths = [backend._path(k) for k in keys]
    return next((i for i, path in enumerate(paths) if not os.path.exists(path)), len(paths))


def old_redis_exists(backend: RedisBackend, keys: list[str], chunk: int = 256) -> int:
    """Redis's exists_prefix before: a pipeline of one EXISTS per key, per chunk of 256."""
    names = [backend._name(k) for k in keys]
    found = 0
    for start in range(0, len(names), chunk):
        pipe = backend._client.pipeline(transaction=False)
        for name in names[start : start + chunk]:
            pipe.exists(name)
        for present in pipe.execute():
            if not present:
                return found
            found += 1
    return found


class Table:
    def __init__(self) -> None:
        print(f"{'path':<52} {'ms':>9}   {'baseline':<40} {'ms':>9} {'ratio':>7}")

    def row(self, what: str, t: float, baseline: str, t_base: float) -> None:
        print(f"{what:<52} {t * 1e3:9.2f}   {baseline:<40} {t_base * 1e3:9.2f} {t / t_base:7.2f}")


def bench_keys(table: Table, tokens: np.ndarray, reps: int) -> None:
    as_list = tokens.tolist()
    assert page_hashes(tokens, PAGE) == old_page_hashes(tokens, PAGE) == page_hashes(as_list, PAGE)
    packed = pack_u32(tokens).tobytes()
    t_sha = best_time(lambda: hashlib.sha256(packed).digest(), reps)
    t_new_np = best_time(lambda: page_hashes(tokens, PAGE), reps)
    t_old_np = best_time(lambda: old_page_hashes(tokens, PAGE), reps)
    t_new_list = best_time(lambda: page_hashes(as_list, PAGE), reps)
    t_old_list = best_time(lambda: old_page_hashes(as_list, PAGE), reps)
    table.row("page_hashes (int64 array)", t_new_np, "old per-page slicing loop", t_old_np)
    table.row("page_hashes (list[int])", t_new_list, "old per-page slicing loop", t_old_list)
    table.row("page_hashes (int64 array)", t_new_np, "one SHA-256 over the same bytes (limit)", t_sha)
    # The chain compresses more than the ids' bytes: each page hashes its parent's digest too, padded
    # (0x80 and the 64-bit length: 9 bytes at least) to whole 64-byte blocks, 2 a page at 16 tokens, so
    # its floor in C is one SHA-256 over that many blocks.
    blocks = len(packed) // (4 * PAGE) * -(-(HASH_BYTES + 4 * PAGE + 9) // 64)
    chain_bytes = bytes(64 * blocks)
    t_chain = best_time(lambda: hashlib.sha256(chain_bytes).digest(), reps)
    table.row("page_hashes (int64 array)", t_new_np, f"SHA-256 of {blocks} blocks (chain limit)", t_chain)
    assert prompt_digest(as_list) == old_prompt_digest(as_list)
    t_digest = best_time(lambda: prompt_digest(as_list), reps)
    t_old_digest = best_time(lambda: old_prompt_digest(as_list), reps)
    t_blake = best_time(lambda: hashlib.blake2b(packed, digest_size=16).digest(), reps)
    table.row("prompt_digest (list[int])", t_digest, "old per-token encoding", t_old_digest)
    table.row("prompt_digest (list[int])", t_digest, "BLAKE2b over the packed bytes (limit)", t_blake)


def add_others(root: str, others: int) -> None:
    """`others` empty objects of other prompts spread over the fan-out directories, written directly
    (a store that has served many conversations; only the directories' sizes matter here)."""
    for i in range(others):
        name = hashlib.sha256(i.to_bytes(8, "little")).hexdigest() + "_" + "f" * 16
        directory = os.path.join(root, name[:2])
        os.makedirs(directory, exist_ok=True)
        os.close(os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT, 0o644))


def bench_file(table: Table, keys: list[str], others: int, reps: int) -> None:
    with tempfile.TemporaryDirectory(prefix="prompt-paths-") as tmp, FileBackend(tmp) as backend:
        backend.batch_put([(k, b"\x01" * 64) for k in keys])
        n = len(keys)

        def check() -> int:
            return backend.exists_prefix(keys)

        assert check() == old_file_exists(backend, keys) == n
        table.row(f"file exists_prefix, {n} pages, store = prompt", best_time(check, reps), "stat per key (old)",
                  best_time(lambda: old_file_exists(backend, keys), reps))  # fmt: skip
        half = keys[: n // 2] + [keys[0][:2] + "0" * 62 + keys[0][64:]] + keys[n // 2 :]
        assert backend.exists_prefix(half) == old_file_exists(backend, half) == n // 2
        table.row(f"file exists_prefix, miss at page {n // 2}", best_time(lambda: backend.exists_prefix(half), reps),
                  "stat per key (old)", best_time(lambda: old_file_exists(backend, half), reps))  # fmt: skip
        start = time.perf_counter()
        add_others(tmp, others)
        print(f"  ({others} other objects written in {time.perf_counter() - start:.1f} s)")
        assert check() == old_file_exists(backend, keys) == n
        table.row(f"file exists_prefix, + {others} other objects", best_time(check, reps), "stat per key (old)",
                  best_time(lambda: old_file_exists(backend, keys), reps))  # fmt: skip


def bench_redis(table: Table, keys: list[str], reps: int) -> None:
    with RedisServer() as server, RedisBackend(server.url) as backend:
        backend.batch_put([(k, b"\x01" * 64) for k in keys])
        n = len(keys)
        assert backend.exists_prefix(keys) == old_redis_exists(backend, keys) == n
        names = [backend._name(k) for k in keys]
        t_new = best_time(lambda: backend.exists_prefix(keys), reps)
        t_old = best_time(lambda: old_redis_exists(backend, keys), reps)
        t_floor = best_time(lambda: backend._client.exists(*names), reps)
        table.row(f"redis exists_prefix, {n} pages", t_new, "pipelined EXISTS per key (old)", t_old)
        table.row(f"redis exists_prefix, {n} pages", t_new, "one EXISTS of every key (count only)", t_floor)


def bench_agreements(pages: int) -> None:
    old = -(-pages // 8)
    for name, page_bytes in (("smollm2", SMOLLM2_PAGE_BYTES), ("tiny", TINY_PAGE_BYTES)):
        most = max(PREFETCH_FIRST_BATCH_PAGES, PREFETCH_BATCH_BYTES // page_bytes)
        new = len(list(read_batches(pages, most)))
        print(f"prefetch agreements for {pages} pages, {name} ({page_bytes:,} B/page): {new} (before: {old})")


def bench_host_reservation(pages: int, reps: int) -> None:
    allocator = PageAllocator(2 * pages, PAGE)

    def reserve() -> None:
        allocator.free(allocator.alloc(pages) or [])

    t = best_time(reserve, reps)
    print(f"host reservation of {pages} pages (alloc + free): {t * 1e3:.2f} ms, {t / pages * 1e9:.0f} ns a page")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--others", type=int, default=128 * 1024, help="other objects in the large file store")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; {args.tokens} tokens, page {PAGE}")
    tokens = np.random.default_rng(0).integers(0, 49152, args.tokens, dtype=np.int64)
    keys = [NS.object_key(h) for h in page_hashes(tokens, PAGE)]
    table = Table()
    bench_keys(table, tokens, args.reps)
    bench_file(table, keys, args.others, args.reps)
    bench_redis(table, keys, args.reps)
    bench_agreements(len(keys))
    bench_host_reservation(len(keys), args.reps)


if __name__ == "__main__":
    main()
