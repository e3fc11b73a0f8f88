"""The seed's section 1.4 figure, reproduced in shape with `hicache simulate` (docs/DESIGN.md, "capacity
simulator", "CP page sharding"; issue 26): CP4 page-sharded KV against KV replicated over the four ranks, at
the same host budget. The seed (production traffic, GLM-5.2-NVFP4, TP4/CP4 on 4 GB300s an engine, 960 GB
of host an engine: one deduplicated pool in the baseline, 240 GB on each of the four shard ranks with CP
sharding): GPU hit rate +40.48 points, combined GPU + host hit rate near 93 % in both, tokens served from
host memory -81.2 % (1.712 B -> 0.322 B); mean prefill queue time -56.2 %, forward time -31.3 %.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_cp.py [--rank-tokens 655360] [--host-tokens 3407872]

The trace is benchmarks/sim_astron.py's coding-agent sessions (Mooncake JSONL, seeded: 24 sessions of 16
turns, a 30K-120K-token history growing 2K-4K a turn, mean ~98K; the seed's traffic is not public). Both
arms run one engine of the `h100x8-llama70b` preset (Llama-70B's KV, 320 KiB a token; GLM-5's is not a
preset) with the same compute: the seed's arms differ in where KV lives, not in the model's work.
Replicated: every rank holds every page, so the logical device pool is one rank's `--rank-tokens`, and
the host tier is one pool of `--host-tokens` (the deduplicated baseline). CP4: the real page placement
(`--cp-size 4`: page q on rank q mod 4, admission by the tightest owner class) over four ranks of
`--rank-tokens` each, and a host tier of `--host-tokens / 4` on each rank. The device pools are sized
against the trace's working set (~3.2 M tokens by its last turns) as the seed's are against its traffic:
one rank's pool holds a fifth of it, four hold most of it, and the host budget holds all of it.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

from benchmarks.sim_astron import VOCAB, add_trace_arguments, written_trace
from hicache.bench.metrics import summarize
from hicache.config import EngineConfig, HiCacheConfig, ParallelConfig
from hicache.sim.cost import load_cost_model
from hicache.sim.simulator import Simulator
from hicache.sim.trace import read_mooncake

PRESET = "h100x8-llama70b"
SEED_DEVICE_POINTS, SEED_HOST_CHANGE, SEED_COMBINED = 40.48, -81.2, 93.0


def simulate(trace: pathlib.Path, cp: int, rank_tokens: int, host_tokens: int) -> tuple[dict, int, float]:
    """The summary, the prompt tokens the host tier served, and the wall time of one arm."""
    cost = load_cost_model(PRESET)
    host_gb = host_tokens // cp * cost.kv_bytes_per_token / 1e9  # a rank's share of the budget
    cfg = EngineConfig(model="tiny", page_size=64, max_total_tokens=rank_tokens, chunked_prefill_size=8192,
                       hicache=HiCacheConfig(enable_hierarchical_cache=True, hicache_size=host_gb),
                       parallel=ParallelConfig(cp_size=cp))  # fmt: skip
    simulator = Simulator(cfg, cost, label=f"CP{cp} sharded" if cp > 1 else "replicated")
    started = time.perf_counter()
    try:
        records = simulator.run(read_mooncake(str(trace), VOCAB))
    finally:
        simulator.shutdown()
    wall_s = time.perf_counter() - started
    host_served = sum((r.cached_tokens_by_tier or {}).get("host", 0) for r in records)
    return summarize(simulator.label, records, simulator.clock.now, {}), host_served, wall_s


def main_bench() -> None:
    parser = argparse.ArgumentParser()
    add_trace_arguments(parser)
    parser.add_argument("--rank-tokens", type=int, default=655_360)  # 200 GiB of Llama-70B KV
    parser.add_argument("--host-tokens", type=int, default=3_407_872)  # 1,040 GiB: the budget of every arm
    parser.add_argument("--cp-size", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = written_trace(pathlib.Path(tmp), args)
        arms = {cp: simulate(trace, cp, args.rank_tokens, args.host_tokens) for cp in (1, args.cp_size)}
    print("| KV on the ranks | device pool (logical) | hit rate (device / host) | ideal | host-served tokens "
          "| TTFT mean / median | wall |\n| --- | ---: | --- | ---: | ---: | ---: | ---: |")  # fmt: skip
    for cp, (s, host_served, wall_s) in arms.items():
        by_tier = s["hit_rate_by_tier"]
        print(f"| {s['arm']} | {cp * args.rank_tokens / 1e6:.2f} M tokens | {100 * s['hit_rate']:.1f}% "
              f"({100 * (by_tier.get('device') or 0):.1f}% / {100 * (by_tier.get('host') or 0):.1f}%) "
              f"| {100 * s['ideal_hit_rate']:.1f}% | {host_served / 1e6:.1f} M | {s['ttft_mean_s']:.2f} s / "
              f"{s['ttft_median_s']:.2f} s | {wall_s:.0f} s |")  # fmt: skip
    (base, base_host, _), (sharded, sharded_host, _) = arms[1], arms[args.cp_size]
    device_points = 100 * (sharded["hit_rate_by_tier"]["device"] - base["hit_rate_by_tier"]["device"])
    host_change = f"{100 * (sharded_host - base_host) / base_host:+.1f}%" if base_host else "n/a (no host hit)"
    print(f"\n| | simulated | the seed |\n| --- | ---: | ---: |\n"
          f"| device hit rate, CP{args.cp_size} - replicated | {device_points:+.1f} points | "
          f"+{SEED_DEVICE_POINTS} points |\n"
          f"| host-served tokens | {host_change} | {SEED_HOST_CHANGE}% |\n"
          f"| combined hit rate, replicated / CP{args.cp_size} | {100 * base['hit_rate']:.1f}% / "
          f"{100 * sharded['hit_rate']:.1f}% | near {SEED_COMBINED:g}% in both |\n"
          f"| mean TTFT (queue + forward) | {100 * (sharded['ttft_mean_s'] / base['ttft_mean_s'] - 1):+.1f}% | "
          "queue -56.2%, forward -31.3% |")  # fmt: skip


if __name__ == "__main__":
    main_bench()
