"""Run ../shared/bench/radix_trace.py for several arms in alternation and report medians and ratios.

Each arm is a process (its own python and PYTHONPATH: SGLang's RadixCache needs its own venv, and the
previous version of hicache's tree is another checkout), so arms are run one after another, round
robin, `--rounds` times; on a shared machine alternating and taking medians is what makes the ratios
comparable. `pagehash` runs inside every arm and shows how much the machine's speed moved.

    python benchmarks/radix_compare.py --bench-dir ../shared/bench --rounds 5 \\
        --arm "sglang|/tmp/sgl/bin/python||sglang,pagehash" \\
        --arm "hicache|.venv/bin/python|$PWD|benchmarks.radix_adapter:RadixAdapter,pagehash"

An arm is "LABEL|PYTHON|PYTHONPATH|BACKENDS" (PYTHONPATH gets the bench dir appended). Results are keyed
"LABEL/backend"; ratios are against `--baseline` (default: the first arm's first backend): the ratio of
the medians, and below it the range of the ratios round by round (each round's baseline against the
same round's backend), which shows how far one round's comparison can be from the median's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# figure -> (how to read it from a result, higher is better)
FIGURES = {
    "inserts/s": (lambda r: r["multiturn"]["insert"]["per_s"], True),
    "matches/s": (lambda r: r["multiturn"]["match"]["per_s"], True),
    "1M insert ms": (lambda r: r["long"]["insert_us"] / 1e3, False),
    "1M match p50 ms": (lambda r: r["long"]["match"]["p50_us"] / 1e3, False),
    "half-way match ms": (lambda r: r["long"]["half_match_us"] / 1e3, False),
}


def run_arm(bench_dir: str, arm: str, extra: list[str]) -> list[dict]:
    label, python, path, backends = arm.split("|")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, bench_dir) if p))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, os.path.join(bench_dir, "radix_trace.py"), "--backends", backends, "--output-file", out.name]
        subprocess.run(cmd + extra, env=env, check=True, stdout=subprocess.DEVNULL, cwd=bench_dir)
        with open(out.name) as f:
            results = json.load(f)["results"]
    for r in results:
        if "error" in r:
            raise SystemExit(f"{label}/{r['backend']}: {r['error']}")
        if r["multiturn"]["match_len_mismatches"] or not r["long"]["match_len_ok"]:
            raise SystemExit(f"{label}/{r['backend']}: matched lengths differ from the expectation")
        r["backend"] = f"{label}/{r['backend']}"
    return results


def times_better(value: float, base: float, higher: bool) -> float:
    """How many times better `value` is than `base`, for a figure where higher (or lower) is better."""
    return value / base if higher else base / value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench-dir", required=True)
    p.add_argument("--arm", action="append", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", default=None)
    p.add_argument("--output-file", default=None)
    args, extra = p.parse_known_args()
    runs: dict[str, list[dict]] = {}
    for i in range(args.rounds):
        for arm in args.arm:
            for r in run_arm(os.path.abspath(args.bench_dir), arm, extra):
                runs.setdefault(r["backend"], []).append(r)
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    medians = {
        b: {f: statistics.median(get(r) for r in rs) for f, (get, _) in FIGURES.items()} for b, rs in runs.items()
    }
    base = args.baseline or next(iter(medians))
    print(f"medians over {args.rounds} rounds; ratio = how many times better than {base}")
    print(f"{'backend':48s}" + "".join(f"{f:>26s}" for f in FIGURES))
    for b, m in medians.items():
        cells, spans = [], []
        for f, (get, higher) in FIGURES.items():
            ratio = times_better(m[f], medians[base][f], higher)
            cells.append(f"{m[f]:12.3g} ({ratio:6.2f}x)".rjust(26))
            per_round = [times_better(get(r), get(r0), higher) for r, r0 in zip(runs[b], runs[base])]
            spans.append(f"{min(per_round):.2f}-{max(per_round):.2f}x".rjust(26))
        print(f"{b:48s}" + "".join(cells))
        print(f"{'  per round':48s}" + "".join(spans))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"medians": medians, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
