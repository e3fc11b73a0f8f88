"""Engine throughput and prefix-cache TTFT, against the machine's matmul limit measured in the same run, and
what the batch-invariant ops cost against plain ones.

    .venv/bin/python benchmarks/engine_bench.py [--models tiny smollm2] [--dtypes float32 bfloat16] [--profile]

Prints the CPU and the matmul GFLOP/s (bf16, fp32); then per model and dtype, for the batch-invariant
ops (what the engine runs) and for plain `F.linear` without padding (what an engine without the
invariant would run), in the same process: prefill tokens/s at 512 and 2048 tokens (and the model
FLOP/s that implies against the matmul limit), decode tokens/s at batch 1, 8 and 32, and the
invariant/plain ratio of each; TTFT of a turn that hits a 2K-token cached prefix against the same
turn with the cache off; with --profile, where the time of a 2K prefill and of a batch-8 decode step
goes (top operators, torch profiler).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import best_time, matmul_gflops  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402

PREFILLS = (512, 2048)
DECODE_BATCHES = (1, 8, 32)
DECODE_STEPS = 32


def cpu_name() -> str:
    name, flags = platform.processor() or "cpu", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = "AVX512+BF16" if "avx512_bf16" in flags else "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    return f"{name} ({isa} in /proc/cpuinfo; torch dispatches {torch.backends.cpu.get_cpu_capability()})"


def flops_per_token(engine: Engine) -> float:
    """2 x (non-embedding parameters): the matmul work per prompt token, attention excluded."""
    c = engine.model_config
    per_layer = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size
    return 2.0 * per_layer * c.num_layers


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 30000 + 300 for i in range(n)]


def ids_for(engine: Engine):
    vocab = engine.tokenizer.vocab_size
    return lambda n, salt: [t % vocab for t in prompt(n, salt)]


def throughput(name: str, dtype: str, invariant: bool) -> dict[str, float]:
    """Prefill and decode tokens/s of one engine (radix cache off: every prompt is computed)."""
    flags = dict(model=name, dtype=dtype, max_total_tokens=65536, chunked_prefill_size=4096, disable_radix_cache=True)
    out = {}
    with Engine(batch_invariant_ops=invariant, **flags) as engine:
        ids = ids_for(engine)
        one = SamplingParams(max_new_tokens=1, ignore_eos=True)
        engine.generate([ids(64, 0)], one)
        for n in PREFILLS:
            out[f"prefill {n}"] = n / best_time(lambda: engine.generate([ids(n, n)], one), repeat=3)
        for batch in DECODE_BATCHES:
            prompts = [ids(128, 100 * batch + b) for b in range(batch)]
            engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm the shapes
            params = SamplingParams(max_new_tokens=DECODE_STEPS + 1, ignore_eos=True)
            start = time.perf_counter()
            results = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start - max(r.ttft_s for r in results)  # decode steps only
            out[f"decode batch {batch}"] = batch * DECODE_STEPS / elapsed
    return out


def bench_invariance_cost(name: str, dtype: str, peak: float, flops: float) -> None:
    inv, plain = throughput(name, dtype, True), throughput(name, dtype, False)
    print(f"\n### {name}, {dtype}\n")
    print("| measurement | invariant ops | plain ops | invariant / plain | invariant vs matmul limit |")
    print("| --- | --- | --- | --- | --- |")
    for key in inv:
        limit = ""
        if key.startswith("prefill"):
            limit = f"{flops * inv[key] / 1e9:.0f} GFLOP/s = {flops * inv[key] / 1e9 / peak:.2f} x"
        print(f"| {key} | {inv[key]:.1f} tok/s | {plain[key]:.1f} tok/s | {inv[key] / plain[key]:.2f} | {limit} |")


def bench_ttft(name: str) -> None:
    common = dict(model=name, max_total_tokens=65536, chunked_prefill_size=4096)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    with Engine(**common) as engine:
        ids = ids_for(engine)
        history = ids(2048, 999)
        turn = history + ids(64, 998)
        engine.generate([history], one)  # cache the 2K history
        hit = min(best_time(lambda: engine.generate([turn], one), repeat=1, warmup=0) for _ in range(3))
    with Engine(disable_radix_cache=True, **common) as off:
        off.generate([ids(64, 0)], one)
        miss = best_time(lambda: off.generate([turn], one), repeat=3)
    print(f"\n{name} (engine dtype): TTFT of a 64-token turn after a cached 2K prefix {hit * 1000:.0f} ms, "
          f"cache off {miss * 1000:.0f} ms, ratio {hit / miss:.3f}")


def where_time_goes(name: str) -> None:
    """Operator breakdown of a 2K prefill and of a batch-8 decode step, in the scheduler's thread."""
    with Engine(model=name, max_total_tokens=65536, chunked_prefill_size=4096, disable_radix_cache=True) as engine:
        vocab = engine.tokenizer.vocab_size
        one = SamplingParams(max_new_tokens=1, ignore_eos=True)
        engine.generate([[t % vocab for t in prompt(64, 5)]], one)
        for label, prompts, params in (
            ("prefill 2048", [[t % vocab for t in prompt(2048, 6)]], one),
            ("decode batch 8 x 16 steps", [[t % vocab for t in prompt(128, 7 + b)] for b in range(8)],
             SamplingParams(max_new_tokens=16, ignore_eos=True)),
        ):
            holder: dict[str, profile] = {}

            def start() -> None:
                holder["p"] = profile(activities=[ProfilerActivity.CPU])
                holder["p"].__enter__()

            engine.call_in_loop(start)
            engine.generate(prompts, params)
            engine.call_in_loop(lambda: holder["p"].__exit__(None, None, None))
            table = holder["p"].key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
            print(f"\n### {name}: {label}\n\n```\n{table}\n```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--profile", action="store_true", help="also print the operator breakdown")
    args = parser.parse_args()
    gflops = {"bfloat16": matmul_gflops(torch.bfloat16), "float32": matmul_gflops(torch.float32)}
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"matmul 2048^2: bf16 {gflops['bfloat16']:.0f} GFLOP/s, fp32 {gflops['float32']:.0f} GFLOP/s")
    for name in args.models:
        with Engine(model=name) as probe:
            flops = flops_per_token(probe)
        for dtype in args.dtypes:
            bench_invariance_cost(name, dtype, gflops[dtype], flops)
        bench_ttft(name)
    if args.profile:
        for name in args.models:
            where_time_goes(name)


if __name__ == "__main__":
    main()
