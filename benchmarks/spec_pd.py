"""Speculation x P/D (docs/DESIGN.md, "Speculation x P/D"; not a test): the bytes a prefill-decode pair moves
with a draft, whose rows cross with the target's, against the same pair without one, measured in the same run.

For each arm (no draft, `tiny-draft-packed`, `tiny-mtp`) an in-process tiny prefill engine sends to a decode
engine with decode reuse over ZeroMQ on loopback; one conversation of two turns (a `--prompt`-token first
prompt, then `--question` more tokens after the answer). Per turn: the tokens and bytes decode received,
the bytes' ratio to the no-draft arm's, and the turn's end-to-end time (prefill, transfer, every decode
step) and its ratio; the acceptance decode reported.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/spec_pd.py [--prompt 1024 --question 64 --new 32]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_name  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import DisaggConfig, EngineConfig, SpeculativeConfig  # noqa: E402
from tests.disagg.pd import PDPair, free_ports  # noqa: E402

ARMS = (None, "tiny-draft-packed", "tiny-mtp")


def pair_for(draft: str | None) -> PDPair:
    spec = SpeculativeConfig("draft", draft, 2) if draft else SpeculativeConfig()
    port = free_ports(1)
    d = DisaggConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
    prefill = Engine(EngineConfig(model="tiny", disagg=d, speculative=spec))
    d = DisaggConfig(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True)
    decode = Engine(EngineConfig(model="tiny", disagg=d, speculative=spec))
    return PDPair(prefill, decode, port)


def run_arm(draft: str | None, prompt: list[int], question: list[int], new: int) -> list[dict]:
    pair = pair_for(draft)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    rows = []
    try:
        history = list(prompt)
        for _ in range(2):
            before = pair.decode.disagg_stats().received_bytes
            start = time.perf_counter()
            (turn,) = pair.run([history], params)
            seconds = time.perf_counter() - start
            if turn.decode.error is not None:
                raise RuntimeError(turn.decode.error)
            spec = turn.decode.spec_tokens or (0, 0)
            rows.append({"tokens": turn.transferred_tokens, "bytes": pair.decode.disagg_stats().received_bytes - before,
                         "seconds": seconds, "accepted": spec[1], "proposed": spec[0]})  # fmt: skip
            history = history + list(turn.decode.token_ids) + question
    finally:
        pair.prefill.shutdown()
        pair.decode.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    rng = random.Random(5)
    prompt = [rng.randrange(32, 127) for _ in range(args.prompt)]
    question = [rng.randrange(32, 127) for _ in range(args.question)]
    print(f"CPU: {cpu_name()}; tiny, float32; K=2 where a draft runs")
    results = {draft: run_arm(draft, prompt, question, args.new) for draft in ARMS}
    base = results[None]
    print("| arm | turn | tokens received | bytes received | vs no draft | turn time | vs no draft | accepted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for draft, rows in results.items():
        for turn, (row, ref) in enumerate(zip(rows, base), 1):
            accepted = f"{row['accepted']}/{row['proposed']}" if draft else "-"
            print(f"| {draft or 'no draft'} | {turn} | {row['tokens']:,} | {row['bytes']:,} | "
                  f"{row['bytes'] / ref['bytes']:.2f}x | {row['seconds'] * 1000:.0f} ms | "
                  f"{row['seconds'] / ref['seconds']:.2f}x | {accepted} |")  # fmt: skip


if __name__ == "__main__":
    main()
