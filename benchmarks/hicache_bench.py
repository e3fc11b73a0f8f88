"""Tier transfer speeds and what a hit on each tier saves, against limits measured in the same run.

    .venv/bin/python benchmarks/hicache_bench.py [--pages 1024] [--model smollm2]

Prints: device -> host backup and host -> device load GB/s for both host layouts against raw memcpy
of the same bytes; page hashing speed for a 1M-token prompt; and the TTFT of a 4K-token prefix served
from host memory and from storage (file) against recomputing it. File and Redis put/get against raw
I/O are measured by benchmarks/storage_bench.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import best_time, memcpy_gbps  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import EngineConfig, HiCacheConfig  # noqa: E402
from hicache.mem.device_pool import DeviceKVPool  # noqa: E402
from hicache.mem.host_pool import LAYOUTS, HostKVPool  # noqa: E402
from hicache.mem.kv_layout import KVLayout  # noqa: E402
from hicache.storage import page_hashes  # noqa: E402


def transfers(pages: int) -> None:
    dtype = EngineConfig().resolved_dtype()
    # smollm2's KV shape: 30 layers x (K, V) x 3 heads x 64.
    device = DeviceKVPool(KVLayout.mha(3, 64), 30, pages, 16, dtype, torch.device("cpu"))
    for buf in device.buffers:
        buf.normal_()
    nbytes = pages * 16 * device.bytes_per_token
    raw = memcpy_gbps(nbytes)
    page_list = list(range(pages))
    print(f"| transfer ({pages} pages, {nbytes / 1e6:.0f} MB) | GB/s | vs memcpy ({raw:.1f} GB/s) |")
    print("| --- | --- | --- |")
    for layout in LAYOUTS:
        host = HostKVPool(device, pages, layout)
        t = best_time(lambda: host.backup(device, page_list, page_list), repeat=3)
        print(f"| backup device -> host, {layout} | {nbytes / t / 1e9:.2f} | {nbytes / t / 1e9 / raw:.2f} x |")

        def load() -> None:
            for layer in range(device.num_layers):
                host.load_layer(device, layer, page_list, page_list)

        t = best_time(load, repeat=3)
        print(f"| load host -> device, {layout} | {nbytes / t / 1e9:.2f} | {nbytes / t / 1e9 / raw:.2f} x |")


def hashing() -> None:
    tokens = np.random.default_rng(0).integers(0, 49152, 1 << 20, dtype=np.int64)
    t = best_time(lambda: page_hashes(tokens, 16), repeat=3)
    print(f"\npage hashing, 1M-token prompt at page 16: {t * 1000:.0f} ms ({len(tokens) / t / 1e6:.1f} M tokens/s)")


def ttft_by_tier(model: str, n: int) -> None:
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as store, Engine(
        model=model,
        max_total_tokens=n * 3 // 2,  # room for one prefix at a time
        chunked_prefill_size=n,
        hicache=HiCacheConfig(
            enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=store
        ),
    ) as engine:
        vocab = engine.tokenizer.vocab_size
        prefix = [(i * 7919) % (vocab - 8) + 4 for i in range(n)]
        other = [(i * 104729) % (vocab - 8) + 4 for i in range(n)]
        turn = prefix + [5, 6, 7, 8]

        def ttft(prompt: list[int]) -> tuple[float, dict]:
            start = time.perf_counter()
            r = engine.generate([prompt], one)[0]
            return time.perf_counter() - start, r.cached_tokens_by_tier

        recompute, _ = ttft(turn)
        ttft(other)  # pushes the prefix out of the device pool; it stays in host memory
        host, host_tiers = ttft(turn)
        ttft(other)
        engine.flush_cache()  # device and host emptied; storage keeps every page
        storage, storage_tiers = ttft(turn)
    print(f"\nTTFT of a 4-token turn after a {n}-token prefix ({model}):")
    print("| served from | TTFT | vs recompute | cached tokens by tier |\n| --- | --- | --- | --- |")
    print(f"| recompute (cold) | {recompute * 1000:.0f} ms | 1.00 | |")
    print(f"| host memory | {host * 1000:.0f} ms | {host / recompute:.3f} | {host_tiers} |")
    print(f"| storage (file) | {storage * 1000:.0f} ms | {storage / recompute:.3f} | {storage_tiers} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    args = parser.parse_args()
    transfers(args.pages)
    hashing()
    ttft_by_tier(args.model, args.prefix_tokens)


if __name__ == "__main__":
    main()
