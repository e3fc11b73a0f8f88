"""A replayable subset of Mooncake's conversation trace (FAST'25 release, `conversation_trace.jsonl`): its
first `--sessions` multi-turn sessions, lengths divided by `--scale` so they fit a small model's context,
for vLLM's own client (`vllm bench serve --dataset-name timed_trace`) against any server (issue 42's replay).

    python benchmarks/mooncake_sessions.py TRACE.jsonl --sessions 29 --scale 16 --out conv96.jsonl
    ../shared/peers/vllm_bench_serve.sh --backend openai --base-url http://127.0.0.1:PORT --model smollm2 \\
        --tokenizer SMOLLM2_HF_DIR --dataset-name timed_trace --dataset-path conv96.jsonl \\
        --timed-trace-chunk-hash-size 32 --timed-trace-sec-multiplier 0.0002 --num-prompts 96 --ignore-eos

The trace names no sessions: a request carries the hash ids of its 512-token blocks, and nearly every one
starts with the same block (a shared system prompt). A request joins the session of the earliest request
that shares the longest prefix of more than that first block with it; a session with two requests or more
is multi-turn. The block size divides by the same scale (512 / 16 = 32: pass it as the chunk hash size),
so equal ids still mean equal tokens. Output lengths divide too, at least 1. Prints what it kept.
"""

from __future__ import annotations

import argparse
import json


def sessions(requests: list[dict]) -> list[list[int]]:
    """Indices of `requests` by session, sessions in order of their first request."""
    owner: dict[tuple, int] = {}  # a block-id prefix longer than one block -> the session that sent it first
    grouped: list[list[int]] = []
    for i, request in enumerate(requests):
        ids = tuple(request["hash_ids"])
        found = next((owner[ids[:cut]] for cut in range(len(ids), 1, -1) if ids[:cut] in owner), None)
        if found is None:
            found = len(grouped)
            grouped.append([])
        grouped[found].append(i)
        for cut in range(2, len(ids) + 1):
            owner.setdefault(ids[:cut], found)
    return grouped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="Mooncake's conversation_trace.jsonl")
    parser.add_argument("--sessions", type=int, default=29, help="multi-turn sessions to keep, first first")
    parser.add_argument("--scale", type=int, default=16, help="divide input and output lengths by this")
    parser.add_argument("--out", required=True, help="where to write the subset (JSON lines)")
    args = parser.parse_args()
    with open(args.trace) as f:
        requests = [json.loads(line) for line in f]
    multi_turn = [s for s in sessions(requests) if len(s) >= 2][: args.sessions]
    kept = sorted(i for s in multi_turn for i in s)
    with open(args.out, "w") as f:
        for i in kept:
            request = dict(requests[i])
            request["input_length"] //= args.scale
            request["output_length"] = max(1, request["output_length"] // args.scale)
            f.write(json.dumps(request) + "\n")
    prompt = sum(requests[i]["input_length"] // args.scale for i in kept)
    longest = max(requests[i]["input_length"] // args.scale for i in kept)
    print(f"{len(multi_turn)} sessions, {len(kept)} requests, {prompt} prompt tokens (longest {longest}), "
          f"block size {512 // args.scale} -> {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
