"""What TP-size invariance costs: prefill and decode with every projection cut into fixed groups
(hicache/model/kernels/tp_groups.py), against the same engine before the cut, in one run (not a test).

    git worktree add /tmp/tp-baseline 8ba7103     # the last commit before the fixed groups
    .venv/bin/python benchmarks/tp_cost.py --baseline-tree /tmp/tp-baseline \\
        [--config smollm2:1 --config tiny:1 --config tiny:2] [--rounds 2]

Each configuration (model:tp) is measured in a process of its own per code tree (this checkout, and
the baseline's), the two trees alternating round by round so that a slow spell of the machine falls on
both; the table shows each figure's median over the rounds and the ratio grouped / baseline (1.00: no
cost). Figures, cache off, default dtype: prefill tok/s of one 512- and one 2048-token prompt (best of
3), and decode tok/s at batch 1 and 8 (32 tokens after 128-token prompts: the time of 32 new tokens
less that of the first, which is the prefill's). The physical floor of the ratio is 1.0: the groups
add GEMM calls of the same total FLOPs and weight bytes, G float32 partials of each row-parallel
projection's output and G - 1 additions of them, nothing a kernel at its limit would need.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFILLS = (512, 2048)
DECODE_BATCHES = (1, 8)
DECODE_PROMPT, DECODE_TOKENS = 128, 32


def measure(model: str, tp: int) -> dict:
    """This process's hicache (the tree on sys.path) at one configuration."""
    from hicache import Engine, SamplingParams
    from hicache.config import ParallelConfig

    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(32, 250) for _ in range(n)]

    def timed(engine, prompts, new: int) -> float:
        started = time.perf_counter()
        results = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
        assert all(r.error is None for r in results)
        return time.perf_counter() - started

    out: dict = {}
    with Engine(model=model, disable_radix_cache=True, max_total_tokens=32768, chunked_prefill_size=4096,
                parallel=ParallelConfig(tp_size=tp)) as engine:  # fmt: skip
        timed(engine, [prompt(64)], 4)  # warm-up: first calls, thread pools
        for n in PREFILLS:
            out[f"prefill {n}"] = n / min(timed(engine, [prompt(n)], 1) for _ in range(3))
        for b in DECODE_BATCHES:
            prompts = [prompt(DECODE_PROMPT) for _ in range(b)]
            first = min(timed(engine, prompts, 1) for _ in range(2))
            whole = min(timed(engine, prompts, DECODE_TOKENS) for _ in range(2))
            out[f"decode b{b}"] = b * (DECODE_TOKENS - 1) / (whole - first)
    return out


def run_in(tree: str, model: str, tp: int) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", f"{model}:{tp}"]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{tree} {model}:{tp} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", help="a checkout of the engine before the fixed groups")
    parser.add_argument("--config", action="append", help="model:tp (repeatable; default smollm2:1 tiny:1 tiny:2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one configuration, JSON out
    args = parser.parse_args()
    if args.measure:
        model, tp = args.measure.split(":")
        print(json.dumps(measure(model, int(tp))))
        return
    if not args.baseline_tree:
        parser.error("--baseline-tree is required")
    trees = {"grouped": HERE, "baseline": os.path.abspath(args.baseline_tree)}
    configs = [(c.split(":")[0], int(c.split(":")[1])) for c in (args.config or ["smollm2:1", "tiny:1", "tiny:2"])]
    figures: dict = {}
    for r in range(args.rounds):
        for model, tp in configs:
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                got = run_in(trees[name], model, tp)
                print(f"round {r + 1} {model} TP{tp} {name}: {json.dumps({k: round(v, 1) for k, v in got.items()})}",
                      file=sys.stderr)  # fmt: skip
                for k, v in got.items():
                    figures.setdefault((model, tp, k), {}).setdefault(name, []).append(v)
    print("| model | TP | figure (tok/s) | baseline | grouped | grouped / baseline | per-round ratios |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (model, tp, k), by in figures.items():
        base, new = statistics.median(by["baseline"]), statistics.median(by["grouped"])
        per_round = ", ".join(f"{n / b:.2f}" for n, b in zip(by["grouped"], by["baseline"]))
        print(f"| {model} | {tp} | {k} | {base:.1f} | {new:.1f} | {new / base:.2f} | {per_round} |")


if __name__ == "__main__":
    main()
