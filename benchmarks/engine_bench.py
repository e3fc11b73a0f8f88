"""Engine throughput and prefix-cache TTFT, against the machine's matmul limit measured in the same run.

    .venv/bin/python benchmarks/engine_bench.py [--models tiny smollm2]

Prints: bf16/fp32 matmul GFLOP/s; per model prefill tokens/s at 512/1024/2048 tokens (and the model
FLOP/s it implies against the matmul limit), decode tokens/s at batch 1, 8 and 32; TTFT of a turn that
hits a 2K-token cached prefix against the same turn with the cache off; and where the time of a 2K
prefill and of a batch-8 decode step goes (top operators, torch profiler).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import best_time, matmul_gflops  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import EngineConfig  # noqa: E402


def flops_per_token(engine: Engine) -> float:
    """2 x (non-embedding parameters): the matmul work per prompt token, attention excluded."""
    c = engine.model_config
    per_layer = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size
    return 2.0 * per_layer * c.num_layers


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 30000 + 300 for i in range(n)]


def bench_model(name: str, peak: float) -> None:
    with Engine(model=name, max_total_tokens=65536, chunked_prefill_size=4096) as engine:
        vocab = engine.tokenizer.vocab_size
        ids = lambda n, s: [t % vocab for t in prompt(n, s)]  # noqa: E731
        one = SamplingParams(max_new_tokens=1, ignore_eos=True)
        engine.generate([ids(64, 0)], one)
        print(f"\n## {name}\n")
        print("| measurement | value | vs limit |\n| --- | --- | --- |")
        salt = 1
        for n in (512, 1024, 2048):
            def run() -> None:
                nonlocal salt
                salt += 1
                engine.generate([ids(n, salt)], one)  # a fresh prompt: no cache hit
            t = best_time(run, repeat=3)
            achieved = flops_per_token(engine) * n / t / 1e9
            print(f"| prefill {n} tokens | {n / t:.0f} tok/s ({t * 1000:.0f} ms) | {achieved:.0f} GFLOP/s = {achieved / peak:.2f} x matmul |")
        for batch in (1, 8, 32):
            new = 32
            salt += 1
            prompts = [ids(128, salt * 100 + b) for b in range(batch)]
            params = SamplingParams(max_new_tokens=new, ignore_eos=True)
            engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))  # prefill cached
            start = time.perf_counter()
            engine.generate(prompts, params)
            t = time.perf_counter() - start
            print(f"| decode batch {batch} | {batch * new / t:.1f} tok/s | |")
        history = ids(2048, 999)
        turn = history + ids(64, 998)
        engine.generate([history], one)  # cache the 2K history
        hit = min(best_time(lambda: engine.generate([turn], one), repeat=1, warmup=0) for _ in range(3))
    with Engine(model=name, max_total_tokens=65536, chunked_prefill_size=4096, disable_radix_cache=True) as off:
        off.generate([ids(64, 0)], one)
        miss = best_time(lambda: off.generate([turn], one), repeat=3)
    print(f"| TTFT, 64-token turn after a cached 2K prefix | {hit * 1000:.0f} ms | cache off: {miss * 1000:.0f} ms, ratio {hit / miss:.3f} |")


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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--profile", action="store_true", help="also print the operator breakdown")
    args = parser.parse_args()
    dtype = EngineConfig().resolved_dtype()
    bf16, fp32 = matmul_gflops(torch.bfloat16), matmul_gflops(torch.float32)
    peak = bf16 if dtype == torch.bfloat16 else fp32
    print(f"matmul 2048^2: bf16 {bf16:.0f} GFLOP/s, fp32 {fp32:.0f} GFLOP/s; engine dtype {dtype}; "
          f"threads {torch.get_num_threads()}")
    for name in args.models:
        bench_model(name, peak)
    if args.profile:
        for name in args.models:
            where_time_goes(name)


if __name__ == "__main__":
    main()
