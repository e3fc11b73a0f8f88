"""The seed's section 5 figure, reproduced in shape with the simulated P/D pair (docs/DESIGN.md, "capacity
simulator"; issue 26): decode-side prefix reuse (device + host) against none, on multi-turn conversations
growing to ~160K tokens. The seed: median TTFT -60.3 % (0.681 -> 0.271 s), mean -25.4 % (2.07 -> 1.54 s),
output throughput +2.9 %.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_pd_reuse.py [--turns 86] [--question 1024] [--output 512]

The trace is the seed's `bench_serving` run (generated-shared-prefix): `--groups` groups of
`--per-group` conversations, each group sharing a `--system`-token first prompt; each turn adds a
`--question`-token question after the previous turn's `--output`-token answer, for `--turns` turns
(the defaults: 4 x 8 conversations, 32K, 1K, 512, 86 turns: a last context of ~160K tokens); every
conversation runs at once, each turn sent when the conversation's previous one ends. Two arms on the same
trace and the same prefill server (its own host tier on, as the seed's): decode without a tree (the
baseline, in the same run) and decode with its tree and a host tier of `--decode-host-gb`. The preset is
`h100x8-llama70b` (Llama-70B's KV, 320 KiB a token; the seed's GLM-5.2-FP8 on B300s is not a preset) with
its `[nic]` (RDMA, 320 GB/s); each server's device pool is `--device-tokens`. `--compute-scale S` multiplies
the preset's GEMM and attention FLOP/s by S (a what-if, not a spec sheet: the seed's FP8 B300 node
prefills several times faster than bf16 H100s, which changes whether prefill's queue or the transfer sets
the TTFT). The prediction is the preset's (public spec sheets), not a GPU's measurement: the seed's figures
are beside it, for shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from hicache.bench.metrics import summarize
from hicache.config import DisaggConfig, EngineConfig, HiCacheConfig
from hicache.sim.cost import load_cost_model
from hicache.sim.pd import PDSimulator
from hicache.sim.trace import TraceRequest

VOCAB = 258  # tiny's: the simulator needs a model only for its vocabulary
# TTFT seconds, reuse off -> on, and the change the seed states (from its unrounded times)
SEED = {"median": (0.681, 0.271, -60.3), "mean": (2.07, 1.54, -25.4)}


def _tokens(seed: tuple[int, ...], n: int) -> list[int]:
    return np.random.default_rng(list(seed)).integers(0, VOCAB, n).tolist()


def conversation_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """Every turn of every conversation; a prompt is built when it arrives (the trace's prompts together
    would not fit in memory)."""
    requests = []
    for conv in range(args.groups * args.per_group):
        group = conv % args.groups

        def prompt(conv: int = conv, group: int = group, turn: int = 0) -> list[int]:
            tokens = _tokens((0, group), args.system)
            for k in range(turn + 1):
                tokens += _tokens((1, conv, k), args.question)
                tokens += _tokens((2, conv, k), args.output) if k < turn else []
            return tokens

        for turn in range(args.turns):
            answer = tuple(_tokens((2, conv, turn), args.output))
            built = (lambda conv=conv, group=group, turn=turn: prompt(conv, group, turn))  # fmt: skip
            requests.append(TraceRequest(conv, group, turn, 0.0, built, answer, after_previous=turn > 0))
    return requests


def arm(args: argparse.Namespace, reuse: bool) -> tuple[dict, PDSimulator, float]:
    host = HiCacheConfig(enable_hierarchical_cache=True, hicache_size=args.prefill_host_gb)
    common = {"model": "tiny", "page_size": 64, "max_total_tokens": args.device_tokens, "chunked_prefill_size": 8192,
              "max_running_requests": 64}  # fmt: skip
    prefill_disagg = DisaggConfig(disaggregation_mode="prefill")
    prefill = EngineConfig(**common, hicache=host, disagg=prefill_disagg)  # type: ignore[arg-type]
    decode_disagg = DisaggConfig(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=reuse)
    decode_hc = dataclasses.replace(host, hicache_size=args.decode_host_gb) if reuse else HiCacheConfig()
    decode = EngineConfig(**common, hicache=decode_hc, disagg=decode_disagg)  # type: ignore[arg-type]
    cost = load_cost_model("h100x8-llama70b")
    c = cost.compute
    scale = args.compute_scale
    scaled = dataclasses.replace(c, flops=c.flops * scale, attention_flops=c.attention_flops * scale)
    simulator = PDSimulator(prefill, decode, dataclasses.replace(cost, compute=scaled),
                            label="decode reuse on" if reuse else "decode reuse off")  # fmt: skip
    started = time.perf_counter()
    try:
        records = simulator.run(conversation_trace(args))
    finally:
        simulator.shutdown()
    wall_s = time.perf_counter() - started
    virtual_s = max(s.clock.now for s in simulator.servers)
    summary = summarize(simulator.label, records, virtual_s, {"kv_bytes_transferred": simulator.kv_link.bytes_moved})
    failed = [r.error for r in records if r.error]
    assert not failed, failed[:3]
    summary["ttfts"] = [r.ttft_s for r in records]
    return summary, simulator, wall_s


def main_bench() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system", type=int, default=32768)
    parser.add_argument("--question", type=int, default=1024)
    parser.add_argument("--output", type=int, default=512)
    parser.add_argument("--turns", type=int, default=86)
    parser.add_argument("--device-tokens", type=int, default=1_835_008)  # 560 GiB of Llama-70B KV
    parser.add_argument("--prefill-host-gb", type=float, default=2000.0)
    parser.add_argument("--decode-host-gb", type=float, default=2000.0)
    parser.add_argument("--compute-scale", type=float, default=1.0)
    args = parser.parse_args()
    last = args.system + args.turns * args.question + (args.turns - 1) * args.output
    print(f"{args.groups * args.per_group} conversations x {args.turns} turns, last context {last:,} tokens; "
          f"compute x {args.compute_scale:g}\n")  # fmt: skip
    results = {reuse: arm(args, reuse) for reuse in (False, True)}
    (off, _, _), (on, _, _) = results[False], results[True]
    print("| | decode reuse off | decode reuse on (device + host) | change | the seed |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for stat, key in (("median", "ttft_median_s"), ("mean", "ttft_mean_s")):
        a, b = off[key], on[key]
        seed_a, seed_b, seed_change = SEED[stat]
        print(f"| TTFT {stat} | {a:.3f} s | {b:.3f} s | {100 * (b - a) / a:+.1f}% "
              f"| {seed_change:+.1f}% ({seed_a} -> {seed_b} s) |")  # fmt: skip
    a, b = off["ttft_p99_s"], on["ttft_p99_s"]
    print(f"| TTFT p99 | {a:.3f} s | {b:.3f} s | {100 * (b - a) / a:+.1f}% | |")
    a, b = off["output_throughput"], on["output_throughput"]
    print(f"| output throughput | {a:,.0f} tok/s | {b:,.0f} tok/s | {100 * (b - a) / a:+.1f}% | +2.9% |")
    for name, key in (("prompt tokens transferred", "transferred_tokens"), ("KV bytes over the NIC",
                                                                            "kv_bytes_transferred")):  # fmt: skip
        a, b = off[key], on[key]
        unit = (lambda n: f"{n / 2**40:.2f} TiB") if key == "kv_bytes_transferred" else (lambda n: f"{n / 1e6:.1f} M")
        print(f"| {name} | {unit(a)} | {unit(b)} | {100 * (b - a) / a:+.1f}% | |")
    for label, (s, simulator, wall_s) in (("off", results[False]), ("on", results[True])):
        prefix = ", ".join(f"{tier} {n / 1e6:.1f} M" for tier, n in simulator.decode_prefix_by_tier.items())
        quartiles = " / ".join(f"{q:.3f}" for q in statistics.quantiles(s["ttfts"], n=4))
        moved = ", ".join(f"{link} {n / 2**40:.2f} TiB" for link, n in simulator.bytes_moved().items())
        print(f"\ndecode reuse {label}: prefill hit rate {100 * s['hit_rate']:.1f}% (ideal "
              f"{100 * s['ideal_hit_rate']:.1f}%); decode's own prefix: {prefix or 'none'}; TTFT quartiles "
              f"{quartiles} s; moved: {moved}; {s['completed']} requests, {s['duration_s']:.0f} s virtual in "
              f"{wall_s:.0f} s wall")  # fmt: skip


if __name__ == "__main__":
    main_bench()
