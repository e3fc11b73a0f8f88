"""The seed's Astron figure, reproduced in shape with `hicache simulate` (docs/DESIGN.md, "capacity
simulator"; issue 26): coding-agent sessions of 30K-200K-token prompts, whose hit rate was about 30 %
without HiCache and 95 % with HiCache and external storage, median TTFT below 3 s (the seed, intro).

    PYTHONPATH=. .venv/bin/python benchmarks/sim_astron.py [--sessions 24] [--turns 16]

The trace (Mooncake JSONL, written by the script; seeded): `--sessions` coding sessions, each a history of
30K-120K tokens at its first turn (a repository's files and instructions, drawn uniformly) that each
later turn extends by 2K-4K tokens (the last answer, tool output, the next instruction), for `--turns`
turns; a session's turns arrive 0.5-1.5x `--think-s` apart (the agent's tools and the user), sessions
starting at random over the first gap, so all of them are open at once. The device pool is the H100 node
preset's HBM left over by Llama-70B's weights (`--device-tokens`, KV of 320 KiB a token), chosen so the
device alone serves about the 30 % the seed starts from: the question is what host memory and a store
behind it do to that. Four configurations on the same trace, in one run: device only (the baseline),
+ a host tier of `--host-gb`, + a file store of `--storage-gb` behind it, with each storage prefetch
policy (`best_effort` admits a request without waiting for its prefetch when the engine is busy;
`wait_complete` waits). The prediction is the preset's
(public spec sheets), not a GPU's measurement: the seed's figures are beside it, for shape.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

from hicache.bench.metrics import summarize
from hicache.config import EngineConfig, HiCacheConfig
from hicache.sim.cost import load_cost_model
from hicache.sim.simulator import Simulator
from hicache.sim.trace import MOONCAKE_BLOCK_TOKENS, read_mooncake

VOCAB = 258  # tiny's: the simulator needs a model only for its vocabulary
SEED_FIGURES = {"device only": "~30 %", "+ host + storage": "95 %, median TTFT < 3 s"}  # by label prefix


def seed_figure(label: str) -> str:
    return next((figure for prefix, figure in SEED_FIGURES.items() if label.startswith(prefix)), "")


def write_trace(path: pathlib.Path, sessions: int, turns: int, think_s: float) -> tuple[int, int]:
    """The trace; (requests, prompt tokens)."""
    rng = np.random.default_rng(0)
    rows, next_block = [], 0
    for session in range(sessions):
        at_ms = rng.uniform(0, think_s * 1000)
        history = list(range(next_block, next_block + int(rng.integers(60, 241))))  # 30K-120K tokens
        next_block += len(history)
        for turn in range(turns):
            if turn:
                grown = int(rng.integers(4, 9))  # 2K-4K tokens
                history += range(next_block, next_block + grown)
                next_block += grown
                at_ms += rng.uniform(0.5, 1.5) * think_s * 1000
            tokens = len(history) * MOONCAKE_BLOCK_TOKENS
            rows.append({"timestamp": at_ms, "input_length": tokens, "output_length": 256, "hash_ids": list(history),
                         "session": session})  # fmt: skip
    rows.sort(key=lambda r: r["timestamp"])
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows), sum(r["input_length"] for r in rows)


def simulate(
    trace: pathlib.Path, device_tokens: int, host_gb: float, store: pathlib.Path | None, storage_gb: float, policy: str
) -> dict:
    storage = {} if store is None else {"hicache_storage_backend": "file", "hicache_storage_dir": str(store),
                                        "hicache_storage_max_bytes": int(storage_gb * 1e9),
                                        "hicache_storage_prefetch_policy": policy}  # fmt: skip
    hc = HiCacheConfig(enable_hierarchical_cache=host_gb > 0, hicache_size=host_gb, **storage)  # type: ignore[arg-type]
    cfg = EngineConfig(model="tiny", page_size=64, max_total_tokens=device_tokens, chunked_prefill_size=8192,
                       hicache=hc)  # fmt: skip
    simulator = Simulator(cfg, load_cost_model("h100x8-llama70b"))
    try:
        records = simulator.run(read_mooncake(str(trace), VOCAB))
    finally:
        simulator.shutdown()
    return summarize(simulator.label, records, simulator.clock.now, {})


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The Astron trace's shape, for every benchmark that replays it."""
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=120.0)


def written_trace(folder: pathlib.Path, args: argparse.Namespace) -> pathlib.Path:
    """The trace of `args` (add_trace_arguments) written into `folder`, its size printed."""
    trace = folder / "trace.jsonl"
    requests, tokens = write_trace(trace, args.sessions, args.turns, args.think_s)
    print(f"{requests} requests, {tokens / 1e6:.1f} M prompt tokens (mean {tokens / requests / 1e3:.0f}K)\n")
    return trace


def main_bench() -> None:
    parser = argparse.ArgumentParser()
    add_trace_arguments(parser)
    parser.add_argument("--device-tokens", type=int, default=1_835_008)  # 560 GiB of KV
    parser.add_argument("--host-gb", type=float, default=900.0)
    parser.add_argument("--storage-gb", type=float, default=30000.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = written_trace(pathlib.Path(tmp), args)
        print("| configuration | hit rate (device / host / storage) | ideal | median TTFT | mean TTFT "
              "| vs device only (median) | the seed | wall |\n| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
        arms = [
            ("device only", 0.0, None, ""),
            (f"+ host {args.host_gb:g} GB", args.host_gb, None, ""),
        ] + [(f"+ host + storage, {policy}", args.host_gb, pathlib.Path(tmp) / policy, policy)
             for policy in ("best_effort", "wait_complete")]  # fmt: skip
        base = None
        for label, host_gb, store, policy in arms:
            started = time.perf_counter()
            s = simulate(trace, args.device_tokens, host_gb, store, args.storage_gb, policy)
            wall_s = time.perf_counter() - started
            base = base or s["ttft_median_s"]
            by_tier = (s["hit_rate_by_tier"].get(t) or 0 for t in ("device", "host", "storage"))
            tiers = " / ".join(f"{100 * rate:.1f}%" for rate in by_tier)
            print(f"| {label} | {100 * s['hit_rate']:.1f}% ({tiers}) | {100 * s['ideal_hit_rate']:.1f}% "
                  f"| {s['ttft_median_s']:.2f} s | {s['ttft_mean_s']:.2f} s | {s['ttft_median_s'] / base:.2f}x "
                  f"| {seed_figure(label)} | {wall_s:.0f} s |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main_bench()
