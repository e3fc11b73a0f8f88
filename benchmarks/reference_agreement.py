"""How close each weight format's next-token distribution is to the independent reference.

    .venv/bin/python benchmarks/reference_agreement.py [--formats none int8 int4 auto] [--dtype bfloat16]

The reference (tests/fixtures/smollm2_reference.json) is transformers' float32 Llama on the same GGUF,
dequantized: 4 prompts x 16 greedy steps, each with its top-5 logprobs. Every step is teacher-forced
(the prompt plus the reference's own greedy tokens before it), so a near-tie early on does not make
the later steps describe another text. Per format: top-1 agreement, the mean overlap of the top-5
sets, the largest and mean |logprob difference| on tokens in both top-5s, and the regret of the
engine's pick (reference best logprob minus the reference logprob of the token the engine generated;
a pick outside the reference's top-5 counts as outside).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from hicache import Engine, SamplingParams  # noqa: E402
from tests.fixtures import SMOLLM2_REFERENCE  # noqa: E402


def agreement(engine: Engine, reference: dict) -> dict[str, float]:
    top1, overlap, diffs, regrets, outside = [], [], [], [], 0
    params = SamplingParams(max_new_tokens=1, logprobs=5, ignore_eos=True)
    for case in reference["cases"]:
        ids, n = case["prompt_ids"] + case["greedy_ids"], len(case["prompt_ids"])
        # Every step of a case in one batch: batch invariance makes each row what it is alone.
        results = engine.generate([ids[: n + i] for i in range(len(case["steps"]))], params)
        for result, step in zip(results, case["steps"]):
            # The pick is the generated token: at an exact tie of bf16 logits the top-5 list may
            # order the tied tokens otherwise than greedy's argmax (lowest id) picks.
            pick, ours = result.token_ids[0], dict(result.logprobs[0].top)
            ref = dict(zip(step["top_ids"], step["top_logprobs"]))
            top1.append(pick == step["top_ids"][0])
            overlap.append(len(ref.keys() & ours.keys()) / len(ref))
            diffs += [abs(ours[t] - ref[t]) for t in ref.keys() & ours.keys()]
            if pick in ref:
                regrets.append(step["top_logprobs"][0] - ref[pick])
            else:
                outside += 1
    return {
        "steps": len(top1),
        "top1": sum(top1) / len(top1),
        "top5_overlap": statistics.mean(overlap),
        "max_logprob_diff": max(diffs),
        "mean_logprob_diff": statistics.mean(diffs),
        "max_regret": max(regrets, default=0.0),
        "outside_top5": outside,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["none", "int8", "int4", "auto"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    reference = json.loads(SMOLLM2_REFERENCE.read_text())
    print(f"smollm2, {args.dtype} activations, teacher-forced over the reference fixture\n")
    print(
        "| --quantization | steps | top-1 agreement | top-5 overlap | max / mean abs logprob diff | max regret "
        "| pick outside ref top-5 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fmt in args.formats:
        with Engine(model="smollm2", dtype=args.dtype, quantization=fmt, max_total_tokens=4096) as engine:
            a = agreement(engine, reference)
        print(
            f"| {fmt} | {a['steps']} | {a['top1']:.3f} | {a['top5_overlap']:.3f} | "
            f"{a['max_logprob_diff']:.3f} / {a['mean_logprob_diff']:.3f} | {a['max_regret']:.3f} | "
            f"{a['outside_top5']} |"
        )


if __name__ == "__main__":
    main()
