"""Draft-free speculation (`--speculative-algorithm ngram`) on a copy-heavy agent workload: decode tok/s
with n-gram proposals against the same model without speculation, measured in the same run (arms alternate
request by request, so load from other jobs falls on both alike), with what was proposed and accepted.

    .venv/bin/python benchmarks/spec_ngram.py [--model smollm2] [--k 4] [--new 128] [--reps 3] [--tiers]

Workloads, each a chat turn on the model's template, greedy, batch 1:
- code edit: a Python file quoted in the prompt, to be shown again with a small change;
- tool output: a test run's log quoted back, its failures to be copied out with their tracebacks;
- open question: nothing to copy (the control: what the verify rows cost where proposals rarely come).

Decode tok/s = generated tokens after the first / (latency - TTFT); speed-up = ngram / off, per workload
and over all of them (total tokens / total decode seconds). Acceptance = accepted / proposed tokens;
accepted per verify = accepted tokens / steps that verified proposals; tokens per step = generated
tokens after the first / target passes (at batch 1 each pass emits 1 + its accepted tokens). The physical
limit it is compared to: tokens per step is the most a speed-up can be if a verify pass of K+1 rows cost a
one-row pass (on a CPU decoding a 135M model it costs more: the rows' GEMMs are no longer pure weight
reads). Both arms must produce the same tokens (checked: greedy output is the target's alone); nothing
timed is asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import cpu_name  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import HiCacheConfig, SpeculativeConfig  # noqa: E402

CODE = '''import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Task:
    name: str
    priority: int
    done: bool = False


def load_tasks(path: Path) -> list[Task]:
    """Read the tasks saved in `path`, one JSON object a line."""
    tasks = []
    for line in path.read_text().splitlines():
        if line.strip():
            tasks.append(Task(**json.loads(line)))
    return tasks


def save_tasks(path: Path, tasks: list[Task]) -> None:
    path.write_text("".join(json.dumps(vars(task)) + "\\n" for task in tasks))


def pending(tasks: list[Task]) -> list[Task]:
    return sorted((task for task in tasks if not task.done), key=lambda task: -task.priority)
'''

LOG = """============================= test session starts ==============================
collected 6 items

tests/test_tasks.py ..F.F.                                                [100%]

=================================== FAILURES ===================================
_____________________________ test_pending_order ______________________________

    def test_pending_order():
        tasks = [Task("a", 1), Task("b", 3), Task("c", 2, done=True)]
>       assert [t.name for t in pending(tasks)] == ["b", "a"]
E       AssertionError: assert ['a', 'b'] == ['b', 'a']

tests/test_tasks.py:21: AssertionError
______________________________ test_save_roundtrip _____________________________

    def test_save_roundtrip(tmp_path):
        path = tmp_path / "tasks.jsonl"
        save_tasks(path, [Task("a", 1)])
>       assert load_tasks(path) == [Task("a", 1)]
E       FileNotFoundError: [Errno 2] No such file or directory: 'tasks.jsonl'

tests/test_tasks.py:30: FileNotFoundError
=========================== short test summary info ============================
FAILED tests/test_tasks.py::test_pending_order - AssertionError
FAILED tests/test_tasks.py::test_save_roundtrip - FileNotFoundError
========================= 2 failed, 4 passed in 0.03s ==========================
"""

WORKLOADS = {
    "code edit": f"Here is tasks.py:\n\n```python\n{CODE}```\n\nAdd a docstring to `pending` and show the whole "
    "file with the change.",
    "tool output": f"I ran the tests:\n\n```\n{LOG}```\n\nCopy out each failure with its traceback, exactly as "
    "shown, then say what to fix.",
    "open question": "Why do rivers meander? Answer in a few paragraphs.",
}
ARMS = ("off", "ngram")


def engines(args: argparse.Namespace) -> dict[str, Engine]:
    kw = {"model": args.model}
    if args.tiers:  # host memory and a file store under the device pool
        store = tempfile.mkdtemp(prefix="spec-ngram-store-")
        kw["hicache"] = HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="file",
                                      hicache_storage_dir=store)  # fmt: skip
    spec = SpeculativeConfig("ngram", None, args.k)
    return {"off": Engine(**kw), "ngram": Engine(**kw, speculative=spec)}


def run(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per workload and arm: [decode tokens, decode seconds, proposed, accepted, verify steps]."""
    params = SamplingParams(max_new_tokens=args.new)
    totals = {w: {arm: [0, 0.0, 0, 0, 0] for arm in ARMS} for w in WORKLOADS}
    arms = engines(args)
    try:
        template = arms["off"].tokenizer.chat_template
        prompts = {w: template.render([{"role": "user", "content": text}]) for w, text in WORKLOADS.items()}
        for engine in arms.values():  # warm-up: the shapes of a prefill and of verify steps
            engine.generate([prompts["code edit"]], SamplingParams(max_new_tokens=8))
        for _ in range(args.reps):
            for w, prompt in prompts.items():
                outputs = {}
                for arm, engine in arms.items():
                    before = engine.spec_stats()
                    r = engine.generate([prompt], params)[0]
                    outputs[arm] = r.token_ids
                    t = totals[w][arm]
                    t[0] += len(r.token_ids) - 1
                    t[1] += r.latency_s - r.ttft_s
                    if before is not None:
                        after = engine.spec_stats()
                        t[2] += after.proposed_tokens - before.proposed_tokens
                        t[3] += after.accepted_tokens - before.accepted_tokens
                        t[4] += after.verify_steps - before.verify_steps
                assert outputs["ngram"] == outputs["off"], f"{w}: speculation changed the greedy output"
    finally:
        for engine in arms.values():
            engine.shutdown()
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--k", type=int, default=4, help="--speculative-num-draft-tokens")
    parser.add_argument("--new", type=int, default=128, help="max new tokens a request (it may stop sooner)")
    parser.add_argument("--reps", type=int, default=3, help="requests per workload and arm")
    parser.add_argument("--tiers", action="store_true", help="host memory and a file store on, in both arms")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}")
    totals = run(args)
    tiers = "host + file tiers" if args.tiers else "device tier only"
    print(
        f"\n{args.model}, greedy, batch 1, up to {args.new} tokens x {args.reps} per workload, K={args.k}, {tiers}:\n"
    )
    print("| workload | off tok/s | ngram tok/s | speed-up | acceptance | accepted per verify | tokens per step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = {**totals, "all": {arm: [sum(totals[w][arm][i] for w in totals) for i in range(5)] for arm in ARMS}}
    for w, arms in rows.items():
        off, ngram = arms["off"][0] / arms["off"][1], arms["ngram"][0] / arms["ngram"][1]
        tokens, _, proposed, accepted, verifies = arms["ngram"]
        acc = f"{accepted / proposed * 100:.0f}% ({accepted}/{proposed})" if proposed else "—"
        per_verify = f"{accepted / verifies:.2f}" if verifies else "—"
        per_step = tokens / (tokens - accepted)
        print(f"| {w} | {off:.1f} | {ngram:.1f} | {ngram / off:.2f}x | {acc} | {per_verify} | {per_step:.2f} |")


if __name__ == "__main__":
    main()
