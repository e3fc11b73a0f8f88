"""`hicache demo`: the README's main job. A multi-turn conversation with a long shared history, run
through the engine with the prefix cache off and on; prints time to first token per turn, the tokens
served from cache, and whether the answers are identical."""

from __future__ import annotations

import argparse
import time

from hicache.config import EngineConfig, add_engine_args

SYSTEM = (
    "You are a careful assistant for a software team. The team maintains a large Python service with "
    "many modules: a scheduler, a memory allocator, a radix tree cache, a storage layer with file and "
    "Redis backends, an HTTP server, and a benchmark suite. "
)
QUESTIONS = [
    "Summarize what a prefix cache does in one sentence.",
    "Why does reusing a cached prefix shorten the time to first token?",
    "Name one risk of caching and how to guard against it.",
    "What should a benchmark of this cache report?",
]


def run_demo(args: argparse.Namespace) -> int:
    from hicache import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    answers: dict[bool, list[list[int]]] = {}
    for use_cache in (False, True):
        cfg = EngineConfig.from_args(args)
        cfg = EngineConfig(**{**cfg.__dict__, "disable_radix_cache": not use_cache})
        with Engine(cfg) as engine:
            messages = [{"role": "system", "content": SYSTEM * args.history_repeats}]
            answers[use_cache] = []
            for turn, question in enumerate(QUESTIONS[: args.turns], 1):
                messages.append({"role": "user", "content": question})
                prompt = engine.tokenizer.chat_template.render(messages)
                start = time.perf_counter()
                result = engine.generate([prompt], params)[0]
                elapsed = time.perf_counter() - start
                messages.append({"role": "assistant", "content": result.text})
                answers[use_cache].append(result.token_ids)
                rows.append((use_cache, turn, result.prompt_tokens, result.cached_tokens, result.ttft_s, elapsed))
    print(f"model {args.model}: {args.turns}-turn conversation, history of ~{rows[0][2]} tokens")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT off (s)':>13} {'TTFT on (s)':>12} {'ratio':>6}")
    off = {r[1]: r for r in rows if not r[0]}
    on = {r[1]: r for r in rows if r[0]}
    for turn in sorted(off):
        ratio = on[turn][4] / off[turn][4]
        print(f"{turn:>4} {off[turn][2]:>7} {on[turn][3]:>7} {off[turn][4]:>13.3f} {on[turn][4]:>12.3f} {ratio:>6.2f}")
    same = answers[False] == answers[True]
    print("answers identical with and without the cache:", "yes" if same else "NO")
    return 0 if same else 1


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="multi-turn conversation with the prefix cache off and on (the main job)")
    add_engine_args(p)
    p.set_defaults(model="smollm2")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history-repeats", type=int, default=12, help="how many times the system prompt is repeated")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(func=run_demo)
