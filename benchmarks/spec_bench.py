"""Speculative decoding: what it costs a storage hit's TTFT, and what it does to decode tokens/s, each
against the same engine without a draft measured in the same run (arms alternate request by request,
so load from other jobs falls on both alike).

    .venv/bin/python benchmarks/spec_bench.py [--model smollm2] [--draft smollm2-draft] [--history 1024]
        [--reps 5] [--ks 1 3] [--new 64]

TTFT: a history of `--history` tokens is written to a file store by a speculative engine (target and
draft pages both); then two engines on that store, without and with the draft, each serve the history
plus a question `--reps` times, flushing device and host memory before each, so every TTFT is a
storage hit (the draft's pages restored with the target's). Decode: three chat prompts, `--new` tokens
each (ignore_eos, greedy, batch 1, cache off), without the draft and with it for each K in `--ks`;
decode tok/s = generated tokens after the first / (latency - TTFT); acceptance = accepted / proposed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.engine_bench import cpu_name  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import HiCacheConfig, SpeculativeConfig  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea.", "Explain photosynthesis briefly."]


def storage_ttft(model: str, draft: str, history_len: int, reps: int, k: int) -> dict[str, float]:
    store = tempfile.mkdtemp(prefix="spec-bench-store-")
    tiers = HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=store)
    spec = SpeculativeConfig("draft", draft, k)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    turn = SamplingParams(max_new_tokens=8, ignore_eos=True)  # a turn that goes on decoding after its first token
    with Engine(model=model, hicache=tiers, speculative=spec) as writer:
        vocab = writer.tokenizer.vocab_size
        low = min(256, vocab // 2)  # past the special tokens
        history = [low + (i * 7919) % (vocab - low - 2) for i in range(history_len)]
        writer.generate([history], one)
    ttft: dict[str, list[float]] = {"without draft": [], "with draft": []}
    with Engine(model=model, hicache=tiers) as plain, Engine(model=model, hicache=tiers, speculative=spec) as drafted:
        arms = {"without draft": plain, "with draft": drafted}
        for rep in range(reps + 1):  # the first round warms both engines' shapes up; not counted
            for arm, engine in arms.items():
                assert engine.flush_cache()
                result = engine.generate([history + history[rep : rep + 3]], turn)[0]
                tiers = result.cached_tokens_by_tier
                assert tiers["storage"] > 0, f"{arm}: no storage hit ({tiers})"
                if rep:
                    ttft[arm].append(result.ttft_s)
    return {arm: statistics.median(values) for arm, values in ttft.items()}


def decode(model: str, draft: str, ks: list[int], new: int) -> dict[str, tuple[float, float | None]]:
    """Per arm: (decode tok/s, acceptance)."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engines = {"without draft": Engine(model=model, disable_radix_cache=True)}
    for k in ks:
        spec = SpeculativeConfig("draft", draft, k)
        engines[f"with draft, K={k}"] = Engine(model=model, disable_radix_cache=True, speculative=spec)
    totals = {arm: [0, 0.0, 0, 0] for arm in engines}  # tokens, seconds, proposed, accepted
    try:
        template = engines["without draft"].tokenizer.chat_template
        prompts = [template.render([{"role": "user", "content": q}]) for q in QUESTIONS]
        for arm, engine in engines.items():
            engine.generate([prompts[0]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        for prompt in prompts:
            for arm, engine in engines.items():
                r = engine.generate([prompt], params)[0]
                t = totals[arm]
                t[0] += len(r.token_ids) - 1
                t[1] += r.latency_s - r.ttft_s
                if r.spec_tokens is not None:
                    t[2] += r.spec_tokens[0]
                    t[3] += r.spec_tokens[1]
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {arm: (t[0] / t[1], t[3] / t[2] if t[2] else None) for arm, t in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft", default="smollm2-draft")
    parser.add_argument("--history", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}")
    ttft = storage_ttft(args.model, args.draft, args.history, args.reps, args.ks[0])
    base = ttft["without draft"]
    print(f"\n{args.model}, TTFT of a {args.history}-token storage hit (median of {args.reps}):\n")
    print("| arm | TTFT | vs without |\n| --- | --- | --- |")
    for arm, value in ttft.items():
        print(f"| {arm} | {value * 1e3:.1f} ms | {value / base:.2f}x |")
    rates = decode(args.model, args.draft, args.ks, args.new)
    base_rate = rates["without draft"][0]
    print(f"\n{args.model}, decode at batch 1, {args.new} tokens x {len(QUESTIONS)} prompts, draft {args.draft}:\n")
    print("| arm | decode tok/s | vs without | acceptance |\n| --- | --- | --- | --- |")
    for arm, (rate, accepted) in rates.items():
        acc = "—" if accepted is None else f"{accepted * 100:.0f}%"
        print(f"| {arm} | {rate:.1f} | {rate / base_rate:.2f}x | {acc} |")


if __name__ == "__main__":
    main()
