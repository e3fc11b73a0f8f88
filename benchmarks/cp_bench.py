"""Context parallelism with page-sharded KV (issue 11), against CP1 measured in the same run (not a test).

    .venv/bin/python benchmarks/cp_bench.py [--model tiny] [--prefix 1536] [--requests 4] [--new 16]

1. Gather against attention, per layer, on each CP2 rank: R requests with distinct P-token prompts are
   computed, then sent again (each now a cached prefix of P - 1 tokens plus one new token, then decode
   steps over the whole prefix). Reported per layer: the all-gather of the prefix pages (gather thread),
   the attention that follows it (forward thread, writes included), how long attention waited for its
   gather (what overlap did not hide) and the step's own-rows KV all-gather; overlap achieved =
   1 - wait / gather. Also the cached pass's TTFT and the decode step time, CP1 vs CP2. On this 2-core
   machine each CP2 rank gets one core: the same silicon as CP1 with two threads, so the physical limit
   of the time ratio is 1.0 and anything above it is what the split costs (gathers, one-thread GEMMs).
2. Cached tokens per rank at a fixed pool size: the same --max-total-tokens per rank, K distinct prompts
   whose KV is about twice the CP1 pool, then the same prompts again, most recent first. Reported:
   tokens the device tier still holds, each rank's device KV bytes, and the device hits of the second
   pass. Physical limit of the ratio: N (less one padding page per rank).
3. The physical floor of a gather: a raw gloo all-gather between two processes of the bytes one layer's
   gather moves per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import ParallelConfig  # noqa: E402
from hicache.engine.launch import free_port  # noqa: E402


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(32, 127, (length,), generator=gen).tolist() for _ in range(count)]


def gather_and_attention(args: argparse.Namespace) -> dict:
    """Part 1 at CP1 and CP2; per-layer costs from the CP2 ranks' own counters."""
    work = prompts(args.requests, args.prefix, seed=1)
    params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    out = {}
    for cp in (1, 2):
        with Engine(model=args.model, max_total_tokens=args.pool, parallel=ParallelConfig(cp_size=cp)) as engine:
            engine.generate(work, params)  # computes and caches the prompts
            before = engine.snapshot().gather_by_rank if cp > 1 else None
            cached = engine.generate(work, params)
            after = engine.snapshot().gather_by_rank if cp > 1 else None
            if cp > 1:  # two buffers, each N ranks x the pool's tokens: a slot's row of one layer
                scratch = next(iter(engine.kv_bytes_by_rank().values()))["scratch"]
                out["row_bytes"] = scratch / (2 * cp * args.pool)
        ttft = statistics.median(r.ttft_s for r in cached)
        step = statistics.median((r.latency_s - r.ttft_s) / (args.new - 1) for r in cached)
        out[cp] = {"ttft_s": ttft, "decode_step_s": step, "hit": sum(r.cached_tokens for r in cached)}
        if after is not None:
            out["ranks"] = {rank: _delta(before[rank], after[rank]) for rank in after}
    return out


def _delta(before, after) -> dict:
    d = {f: getattr(after, f) - getattr(before, f) for f in vars(after)}
    layers = max(d["layers"], 1)
    return {
        "gather_ms_per_layer": 1e3 * d["gather_s"] / layers,
        "attention_ms_per_layer": 1e3 * d["attend_s"] / max(d["attended_layers"], 1),
        "wait_ms_per_layer": 1e3 * d["wait_s"] / max(d["attended_layers"], 1),
        "step_kv_ms_per_layer": 1e3 * d["step_kv_s"] / max(d["attended_layers"], 1),
        "overlap": 1 - d["wait_s"] / d["gather_s"] if d["gather_s"] else 0.0,
        "pages_per_layer": d["pages"] / layers,
    }


def cached_tokens_at_fixed_pool(args: argparse.Namespace) -> dict:
    """Part 2."""
    length = 512
    count = 2 * args.pool // length  # twice what one rank's pool holds
    work = prompts(count, length, seed=2)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    out = {}
    for cp in (1, 2):
        with Engine(model=args.model, max_total_tokens=args.pool, parallel=ParallelConfig(cp_size=cp)) as engine:
            for p in work:
                engine.generate([p], params)
            held = engine.pool_usage()["device"]
            bytes_by_rank = {rank: b["device"] for rank, b in engine.kv_bytes_by_rank().items()}
            # Most recent first: an LRU cache keeps the latest prompts, so this counts what it kept
            # (in issue order a scan would evict each prompt just before its turn).
            again = [engine.generate([p], params)[0] for p in reversed(work)]
        out[cp] = {
            "held_tokens": held[0],
            "capacity_tokens": held[1],
            "device_bytes_per_rank": bytes_by_rank,
            "device_hits": sum(r.cached_tokens_by_tier["device"] for r in again),
            "prompt_tokens": count * length,
        }
    return out


def _raw_gather(rank: int, port: int, nbytes: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    send = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    out = torch.empty(2, nbytes // 2, dtype=torch.bfloat16)
    times = []
    for _ in range(30):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather(list(out.unbind(0)), send)
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put(min(times[5:]))
    dist.destroy_process_group()


def raw_gather_s(nbytes: int) -> float:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_raw_gather, args=(r, port, nbytes, results)) for r in range(2)]
    for p in procs:
        p.start()
    best = results.get(timeout=120)
    for p in procs:
        p.join(30)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prefix", type=int, default=1536)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--pool", type=int, default=8192, help="--max-total-tokens, per rank")
    args = parser.parse_args()
    print(f"model {args.model}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")

    part1 = gather_and_attention(args)
    print(f"\n1. {args.requests} cached prefixes of {args.prefix - 1} tokens + 1 new, then {args.new - 1} decode steps")
    print("| | CP1 | CP2 | CP2 / CP1 |\n| --- | ---: | ---: | ---: |")
    for key, label in (("ttft_s", "TTFT, cached pass (median, s)"), ("decode_step_s", "decode step (median, s)")):
        a, b = part1[1][key], part1[2][key]
        print(f"| {label} | {a:.4f} | {b:.4f} | {b / a:.2f} |")
    print("\n| CP2 rank | gather ms/layer | attention ms/layer | wait ms/layer | own-rows KV ms/layer | overlap | "
          "pages/layer |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
    layer_bytes = 0.0
    for rank, r in part1["ranks"].items():
        print(f"| {rank} | {r['gather_ms_per_layer']:.3f} | {r['attention_ms_per_layer']:.3f} | "
              f"{r['wait_ms_per_layer']:.3f} | {r['step_kv_ms_per_layer']:.3f} | {r['overlap']:.0%} | "
              f"{r['pages_per_layer']:.0f} |")  # fmt: skip
        layer_bytes = r["pages_per_layer"] / 2 * 16 * part1["row_bytes"]  # per rank: its half of the pages

    part2 = cached_tokens_at_fixed_pool(args)
    print(f"\n2. fixed pool of {args.pool} tokens per rank, {part2[1]['prompt_tokens']} distinct prompt tokens")
    print("| | CP1 | CP2 | CP2 / CP1 |\n| --- | ---: | ---: | ---: |")
    for key, label in (("capacity_tokens", "logical pool (tokens)"), ("held_tokens", "tokens cached on the device"),
                       ("device_hits", "device hits, second pass (tokens)")):  # fmt: skip
        a, b = part2[1][key], part2[2][key]
        print(f"| {label} | {a} | {b} | {b / max(a, 1):.2f} |")
    for cp in (1, 2):
        print(f"CP{cp} device KV bytes per rank: {part2[cp]['device_bytes_per_rank']}")

    if layer_bytes:
        best = raw_gather_s(int(layer_bytes))
        print(f"\n3. raw gloo all-gather of {layer_bytes / 1e6:.2f} MB per rank (one layer's gather): "
              f"{best * 1e3:.3f} ms ({2 * layer_bytes / best / 1e9:.2f} GB/s gathered)")  # fmt: skip


if __name__ == "__main__":
    main()
