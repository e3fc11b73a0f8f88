"""Rank agreement's cost, and TTFT with tensor / pipeline parallel ranks, against baselines measured in the
same run (not a test).

    .venv/bin/python benchmarks/parallel_bench.py [--model tiny] [--steps 30] [--calls 2000]

1. One consensus check, in µs, at TP2, PP2 and TP2xPP2 (real rank processes, gloo on loopback):
   `Consensus.agree_min` alone (the TP MIN all-reduce on its gloo group, or the pp_sync receive and
   forward) and a whole hierarchical `PrefixCache.check()` with empty queues (what every scheduler step pays
   when nothing completed), against one decode step of 8 requests with 512-token contexts at the same
   topology, and against one gloo all-reduce of a scalar (the physical floor of any agreement); also
   the rank worker's per-step broadcast of (empty) inputs from rank 0, and the disabled consensus
   checker's per-step hook, in ns.
2. TTFT of one request (cache off) at 512 / 1024 / 2048 prompt tokens at TP1, TP2 and PP2, each run in
   the same script. On this 2-core machine TP2 gives each rank one core: the same silicon as TP1 with
   two threads, so the physical limit for the ratio is 1.0 (no speed-up is possible), and anything
   above it is the cost of the split (all-reduces, per-step broadcasts, 1-thread GEMMs).

Medians over the repetitions; each rank reports its own and the table shows the slowest rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import EngineConfig, HiCacheConfig, ParallelConfig  # noqa: E402
from hicache.debug.consensus_checker import ConsensusChecker  # noqa: E402
from hicache.engine.build import build_scheduler  # noqa: E402
from hicache.engine.launch import free_port  # noqa: E402
from hicache.engine.rank_worker import RankSpec, init_distributed  # noqa: E402
from hicache.model.loading.loader import load_model  # noqa: E402
from hicache.scheduler.request import FinishReason, Request  # noqa: E402

DECODE_BATCH = 8
DECODE_CONTEXT = 512


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _rank(rank: int, cfg: EngineConfig, init_method: str, threads: int, calls: int, steps: int, results) -> None:
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    spec = RankSpec(rank, rank, cfg.parallel.world_size, init_method, threads, 30)
    pctx = init_distributed(spec, cfg)
    scheduler = build_scheduler(cfg, load_model(cfg.model), pctx)
    cache = scheduler.cache
    scalar = torch.zeros(1, dtype=torch.int64)
    out = {
        "allreduce_us": _median_us(
            lambda: dist.all_reduce(scalar, op=dist.ReduceOp.MIN, group=pctx.world_group), calls
        ),
        "agree_us": _median_us(lambda: cache.consensus.agree_min("bench", [0, 0]), calls),  # type: ignore[attr-defined]
        "check_us": _median_us(cache.check, calls),
        "inputs_us": _median_us(lambda: dist.broadcast_object_list([[]], src=0, group=pctx.world_group), calls),
    }
    for i in range(DECODE_BATCH):  # the same requests, in the same order, on every rank
        prompt = [(j * 7 + i * 13) % 200 + 33 for j in range(DECODE_CONTEXT)]
        scheduler.add(
            Request(prompt, SamplingParams(max_new_tokens=steps + 16, ignore_eos=True), steps + 16, rid=i + 1)
        )
    while any(r.in_prefill for r in scheduler.running) or scheduler.waiting:
        scheduler.step()
    dist.barrier(group=pctx.world_group)
    out["decode_step_us"] = _median_us(scheduler.step, steps)
    gathered = [None] * pctx.world_size
    dist.all_gather_object(gathered, out, group=pctx.world_group)
    if rank == 0:
        results.put(gathered)
    scheduler.abort_all(FinishReason.ABORT, "benchmark over")
    cache.shutdown()
    dist.barrier(group=pctx.world_group)
    dist.destroy_process_group()


def consensus_costs(cfg: EngineConfig, calls: int, steps: int) -> dict[str, float]:
    world = cfg.parallel.world_size
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = [ctx.Process(target=_rank, args=(r, cfg, init, threads, calls, steps, results)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


def ttft_ms(engine: Engine, n: int, reps: int) -> float:
    vocab = engine.tokenizer.vocab_size
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    times = []
    for rep in range(reps):
        ids = [(i * 7919 + (rep + 1) * 104729 + n) % (vocab - 1) for i in range(n)]
        times.append(engine.generate([ids], one)[0].ttft_s)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--calls", type=int, default=2000, help="consensus calls timed per topology")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per topology")
    parser.add_argument("--reps", type=int, default=3, help="TTFT repetitions per prompt length")
    args = parser.parse_args()

    store = tempfile.mkdtemp(prefix="parallel-bench-")
    hicache = HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=store)
    base = EngineConfig(model=args.model, max_total_tokens=16384, hicache=hicache)

    print("## One consensus check vs one decode step\n")
    print(f"decode step: {DECODE_BATCH} requests, {DECODE_CONTEXT}-token contexts; model {args.model}\n")
    columns = ("topology", "gloo all-reduce (floor)", "agree_min", "cache.check()", "input broadcast", "decode step")
    print("| " + " | ".join(columns) + " | check / step |")
    print("| --- " * (len(columns) + 1) + "|")
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        cfg = replace(base, parallel=ParallelConfig(tp_size=tp, pp_size=pp))
        c = consensus_costs(cfg, args.calls, args.steps)
        share = 100 * c["check_us"] / c["decode_step_us"]
        print(
            f"| TP{tp} x PP{pp} | {c['allreduce_us']:.0f} µs | {c['agree_us']:.0f} µs | {c['check_us']:.0f} µs "
            f"| {c['inputs_us']:.0f} µs | {c['decode_step_us'] / 1e3:.1f} ms | {share:.1f} % |"
        )
    checker = ConsensusChecker(env={})
    hook_ns = _median_us(checker.checkpoint, 100000) * 1e3
    print(f"\nDisabled consensus checker, per-step hook: {hook_ns:.0f} ns (a method call that returns).\n")

    print("## TTFT with parallel ranks (cache off)\n")
    print("| prompt tokens | TP1 | TP2 | TP2 / TP1 | PP2 | PP2 / TP1 |\n| --- | --- | --- | --- | --- | --- |")
    lengths = (512, 1024, 2048)
    ttft: dict[str, dict[int, float]] = {}
    for name, par in (
        ("TP1", ParallelConfig()),
        ("TP2", ParallelConfig(tp_size=2)),
        ("PP2", ParallelConfig(pp_size=2)),
    ):
        with Engine(replace(base, disable_radix_cache=True, hicache=HiCacheConfig(), parallel=par)) as engine:
            ttft_ms(engine, 64, 1)  # warm-up
            ttft[name] = {n: ttft_ms(engine, n, args.reps) for n in lengths}
    for n in lengths:
        t1, t2, p2 = ttft["TP1"][n], ttft["TP2"][n], ttft["PP2"][n]
        print(f"| {n} | {t1:.0f} ms | {t2:.0f} ms | {t2 / t1:.2f} | {p2:.0f} ms | {p2 / t1:.2f} |")
    print(f"\nPhysical limit of TP2 / TP1 on this machine: 1.00 ({os.cpu_count()} cores either way).")


if __name__ == "__main__":
    main()
