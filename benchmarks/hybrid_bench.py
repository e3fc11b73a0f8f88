"""`tiny-hybrid` (docs/DESIGN.md, "Hybrid models") against `tiny`, the Llama of the same size, each with its
cache off and on, measured in the same run: what a multi-turn workload's cached prefixes save a hybrid,
what a decode step pays for the recurrent scan, and what a cached prefix holds in device memory.

    .venv/bin/python benchmarks/hybrid_bench.py [--convs 4] [--system 1024] [--question 64] [--turns 4] [--new 16]

Workload: `--convs` conversations in two groups sharing a `--system`-token system prompt, each turn adding
a `--question`-token question to the whole history (token ids, not text), all conversations' turns
submitted together; greedy, `--new` tokens a turn. Per arm: hit rate (cached / prompt tokens over turns
2..), mean TTFT over turns 2.. and its ratio to the same model's cache-off arm, and decode ms per token
(latency - TTFT over the tokens after the first). Arms run one after another, so load from other jobs
is not shared alike: the ratios within a model are what to read. Memory: the pool's bytes per token and
those of a cached 32K-token prefix, computed from each model's pool row.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import cpu_name  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402
from hicache.model.families.hybrid import SLIDING  # noqa: E402

PREFIX = 32768


def workload(convs: int, system: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32, 127) for _ in range(system)] for _ in range(2)]
    return [list(systems[c % 2]) for c in range(convs)]


def run_arm(model: str, cache: bool, args) -> dict[str, float]:
    histories, rng = workload(args.convs, args.system), random.Random(1)
    params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    cached = prompt = 0
    ttfts, decode_ms = [], []
    with Engine(model=model, disable_radix_cache=not cache, max_total_tokens=16384) as engine:
        for turn in range(args.turns):
            for h in histories:
                h.extend(rng.randrange(32, 127) for _ in range(args.question))
            results = engine.generate([list(h) for h in histories], params)
            for h, r in zip(histories, results):
                h.extend(r.token_ids)
                decode_ms.append(1000 * (r.latency_s - r.ttft_s) / (args.new - 1))
                if turn:
                    cached, prompt = cached + r.cached_tokens, prompt + r.prompt_tokens
                    ttfts.append(r.ttft_s)
    return {"hit_rate": cached / prompt, "ttft_ms": 1000 * statistics.mean(ttfts),
            "decode_ms": statistics.median(decode_ms)}  # fmt: skip


def memory() -> None:
    for name in ("tiny", "tiny-hybrid"):
        with Engine(model=name, max_total_tokens=4096) as engine:
            pool = engine._runtime.scheduler.runner.pool
            model = engine._runtime.scheduler.runner.model
        per_token = pool.bytes_per_token
        whole = PREFIX * per_token / 2**20
        line = f"{name}: row {pool.layout.describe()}, {per_token} B/token, 32K prefix {whole:.1f} MiB"
        if name == "tiny-hybrid":
            element = pool.buffers[0].element_size()
            state = model.linear_layout.row_numel  # over the K and V columns of the linear layer's rows
            kv = pool.layout.span("v")[0] + pool.layout.span("v")[1]
            sliding = model.layer_types.count(SLIDING)
            window = model.cfg.sliding_window + pool.page_size  # the window's pages, a partial one at each end
            kept_if_freed = (PREFIX * per_token - sliding * (PREFIX - window) * kv * element) / 2**20
            line += (f"; the recurrent layer's columns {state} of {pool.layout.row_numel} per row; "
                     f"if sliding layers kept only the window tail (not built): {kept_if_freed:.1f} MiB")  # fmt: skip
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--convs", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new", type=int, default=16)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; {vars(args)}")
    print("| model | cache | hit rate (turns 2..) | mean TTFT (turns 2..) | vs cache off | decode ms/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in ("tiny", "tiny-hybrid"):
        off = run_arm(model, False, args)
        on = run_arm(model, True, args)
        for label, arm in (("off", off), ("device", on)):
            print(f"| {model} | {label} | {arm['hit_rate']:.0%} | {arm['ttft_ms']:.1f} ms | "
                  f"{arm['ttft_ms'] / off['ttft_ms']:.2f}x | {arm['decode_ms']:.2f} |")  # fmt: skip
    memory()


if __name__ == "__main__":
    main()
