"""A capacity sweep with `hicache simulate` (docs/DESIGN.md, "capacity simulator"; issue 26): hit rate
and median TTFT against the host tier's size, then against a file store's size behind a host tier of
`--storage-host-gb`, for one trace, and each tier's occupancy over time at the largest of each, as a
plot in docs/.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_sweep.py [--requests 300] [--host-gb 0 50 100 200 300 400 600] \
        [--storage-host-gb 100 --storage-gb 0 100 200 300 400 600]

The trace is Mooncake JSONL of sim_bench.py's shape (`--groups` documents, each request one document's
shared first 3/4 and blocks of its own, one every `--gap-ms`) but each request's document drawn at
random (in turn, every document would come back after all the others: LRU's worst case, no hit at all
below the whole working set), simulated with the H100 node preset on a device
pool of `--device-tokens` (below the documents' shared prefixes together, so the host tier decides);
host size 0 is the device alone. The baseline is the device-only run in the same sweep; storage size 0
is the host tier alone, each other size a new file store capped at it (`--hicache-storage-max-bytes`,
in bytes of the modelled KV).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

from hicache.bench.metrics import summarize  # noqa: E402
from hicache.config import EngineConfig, HiCacheConfig  # noqa: E402
from hicache.sim.cost import load_cost_model  # noqa: E402
from hicache.sim.simulator import Simulator  # noqa: E402
from hicache.sim.trace import MOONCAKE_BLOCK_TOKENS, read_mooncake  # noqa: E402

VOCAB = 258  # tiny's: the simulator needs a model only for its vocabulary


def write_trace(path: pathlib.Path, requests: int, tokens: int, groups: int, gap_ms: float) -> None:
    blocks = -(-tokens // MOONCAKE_BLOCK_TOKENS)
    shared = blocks * 3 // 4
    documents = np.random.default_rng(0).integers(0, groups, requests)
    with open(path, "w", encoding="utf-8") as f:
        for i, group in enumerate(documents.tolist()):
            own = [10_000_000 + i * blocks + b for b in range(blocks - shared)]
            hash_ids = [group * blocks + b for b in range(shared)] + own
            row = {"timestamp": i * gap_ms, "input_length": tokens, "output_length": 64, "hash_ids": hash_ids}
            f.write(json.dumps(row) + "\n")


def simulate(
    trace: pathlib.Path, host_gb: float, device_tokens: int, store: pathlib.Path | None = None, storage_gb: float = 0
) -> tuple[dict, Simulator]:
    """One point of the sweep; with `store`, a file store there capped at `storage_gb` GB of KV."""
    storage = {} if store is None else {"hicache_storage_backend": "file", "hicache_storage_dir": str(store),
                                        "hicache_storage_max_bytes": int(storage_gb * 1e9)}  # fmt: skip
    hc = HiCacheConfig(enable_hierarchical_cache=host_gb > 0, hicache_size=host_gb, **storage)  # type: ignore[arg-type]
    cfg = EngineConfig(model="tiny", page_size=64, max_total_tokens=device_tokens, chunked_prefill_size=8192,
                       hicache=hc)  # fmt: skip
    label = f"host {host_gb:g} GB" + (f", storage {storage_gb:g} GB" if store is not None else "")
    simulator = Simulator(cfg, load_cost_model("h100x8-llama70b"), label=label)
    try:
        records = simulator.run(read_mooncake(str(trace), VOCAB))
    finally:
        simulator.shutdown()
    return summarize(simulator.label, records, simulator.clock.now, {}), simulator


def main_bench() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=2000.0)
    parser.add_argument("--device-tokens", type=int, default=2**18)
    parser.add_argument("--host-gb", type=float, nargs="+", default=[0, 50, 100, 200, 300, 400, 600])
    parser.add_argument("--storage-host-gb", type=float, default=100.0)
    parser.add_argument("--storage-gb", type=float, nargs="+", default=[0, 100, 200, 300, 400, 600])
    parser.add_argument("--out", default="docs/sim_capacity_sweep.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = pathlib.Path(tmp) / "trace.jsonl"
        write_trace(trace, args.requests, args.tokens, args.groups, args.gap_ms)
        print("| host tier | hit rate (device / host) | ideal | median TTFT | vs device only | wall |")
        print("| ---: | --- | ---: | ---: | ---: | ---: |")
        host = sweep(args.host_gb, lambda gb: simulate(trace, gb, args.device_tokens), ("device", "host"))
        print(f"\n| file store behind {args.storage_host_gb:g} GB of host | hit rate (device / host / storage) "
              "| ideal | median TTFT | vs host only | wall |\n| ---: | --- | ---: | ---: | ---: | ---: |")  # fmt: skip

        def with_store(gb: float) -> tuple[dict, Simulator]:
            store = pathlib.Path(tmp) / f"store-{gb:g}" if gb else None
            return simulate(trace, args.storage_host_gb, args.device_tokens, store, gb)

        storage = sweep(args.storage_gb, with_store, ("device", "host", "storage"))
    plot(host, storage, args)
    print(f"\nwrote {args.out}")


Sweep = tuple[list[tuple[float, dict]], list]  # (size in GB, summary) by size; the largest's occupancy


def sweep(sizes: list[float], run, tiers: tuple[str, ...]) -> Sweep:  # noqa: ANN001 - size -> (summary, simulator)
    """Each size simulated in turn, a table row printed as it ends; the first size is the baseline."""
    rows, occupancy = [], []
    for gb in sizes:
        started = time.perf_counter()
        summary, simulator = run(gb)
        wall_s = time.perf_counter() - started
        rows.append((gb, summary))
        if gb == max(sizes):
            occupancy = simulator.occupancy
        base = rows[0][1]["ttft_median_s"]
        by_tier = " / ".join(f"{100 * (summary['hit_rate_by_tier'].get(t) or 0):.1f}%" for t in tiers)
        print(f"| {gb:g} GB | {100 * summary['hit_rate']:.1f}% ({by_tier}) | {100 * summary['ideal_hit_rate']:.1f}% "
              f"| {1000 * summary['ttft_median_s']:.0f} ms | {summary['ttft_median_s'] / base:.2f}x "
              f"| {wall_s:.0f} s |", flush=True)  # fmt: skip
    return rows, occupancy


def plot(host: Sweep, storage: Sweep, args: argparse.Namespace) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.4))
    panels = (
        (axes[0], host, "host tier", f"host {max(args.host_gb):g} GB"),
        (axes[1], storage, f"file store behind {args.storage_host_gb:g} GB of host",
         f"host {args.storage_host_gb:g} GB, storage {max(args.storage_gb):g} GB"),
    )  # fmt: skip
    for (hits, ttft, tiers), (rows, occupancy), what, largest in panels:
        sizes = [gb for gb, _ in rows]
        hits.plot(sizes, [100 * s["hit_rate"] for _, s in rows], "o-", label="hit rate")
        hits.plot(sizes, [100 * s["ideal_hit_rate"] for _, s in rows], "--", color="grey", label="the trace's ideal")
        hits.set(xlabel=f"{what} (GB of KV)", ylabel="% of prompt tokens", title="hit rate", ylim=(0, 100))
        hits.legend()
        ttft.plot(sizes, [1000 * s["ttft_median_s"] for _, s in rows], "o-")
        ttft.set(xlabel=f"{what} (GB of KV)", ylabel="ms", title="median TTFT", ylim=(0, None))
        times = [t for t, _ in occupancy]
        for tier in ("device", "host"):  # what the tiers in memory hold (a store's bytes are its own)
            tiers.plot(times, [used.get(tier, 0) / 1e6 for _, used in occupancy], label=tier)
        tiers.set(xlabel="virtual time (s)", ylabel="M tokens held", title=f"occupancy, {largest}")
        tiers.legend()
    fig.suptitle(f"hicache simulate, h100x8-llama70b: {args.requests} requests of {args.tokens} tokens, "
                 f"{args.groups} shared documents, device pool {args.device_tokens} tokens")  # fmt: skip
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)


if __name__ == "__main__":
    main_bench()
