"""Routing policies against each other (docs/DESIGN.md, "router"; not a test): hit rate and median TTFT
of one workload through `hicache router --policy round-robin`, `first-message` and `cache-aware`, in one
run, in front of the same two `hicache serve --model tiny` servers (their caches flushed between arms).

The workload: conversations in groups; every conversation starts with one common system prompt, then
its group's long document, then its own questions, turn after turn (the answers in the history);
conversations start interleaved across groups, `--concurrency` at a time, each running its turns in
order. Each server's device pool holds about half of the distinct tokens, so where a group's turns land
decides whether its document is still cached there. Hit rate: cached prompt tokens over prompt tokens
(every tier, from each response's usage). The first-message policy hashes the common system prompt,
so every conversation meets one server: the case issue 25 names.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/routing_bench.py [--groups 4 --per-group 3 --turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_name  # noqa: E402
from hicache.bench.client import StreamResult, build_payload, stream_request  # noqa: E402
from hicache.bench.launcher import ServerProcess  # noqa: E402
from hicache.bench.workload import Conversation, Turn, conversation_messages  # noqa: E402
from hicache.router.policies import POLICIES  # noqa: E402
from tests.disagg.pd import free_ports  # noqa: E402

WORDS = "cache page tier host device storage prefix token router server event batch index chain".split()


def text(rng: random.Random, chars: int) -> str:
    """About `chars` tokens of `tiny` (its tokens are bytes)."""
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + " "
    return out[:chars]


def workload(args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(25)
    system = text(rng, args.system_len)
    documents = [text(rng, args.document_len) for _ in range(args.groups)]
    convs = []
    for index in range(args.per_group):  # interleaved: group 0, 1, 2, ... of the first, then the second
        for group in range(args.groups):
            turns = tuple(Turn(text(rng, args.question_len), args.output_len) for _ in range(args.turns))
            convs.append(Conversation(len(convs), group, system, documents[group], turns))
    return convs


async def converse(client: httpx.AsyncClient, conv: Conversation, slots: asyncio.Semaphore) -> list[StreamResult]:
    results: list[StreamResult] = []
    answers: list[str] = []
    async with slots:
        for turn in range(len(conv.turns)):
            messages = conversation_messages(conv, turn, answers)
            path, body = build_payload("chat", "tiny", messages, "", conv.turns[turn].output_len, {"ignore_eos": True})
            result = await stream_request(client, path, body)
            if result.error is not None:
                raise RuntimeError(result.error)
            results.append(result)
            answers.append(result.text)
    return results


async def run_arm(url: str, convs: list[Conversation], concurrency: int) -> list[StreamResult]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as client:
        flushed = await client.post("/flush_cache")
        flushed.raise_for_status()
        slots = asyncio.Semaphore(concurrency)
        tasks = []
        for conv in convs:
            tasks.append(asyncio.create_task(converse(client, conv, slots)))
            await asyncio.sleep(0.05)  # arrivals in the workload's interleaved order
        return [r for results in await asyncio.gather(*tasks) for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--document-len", type=int, default=1536)
    parser.add_argument("--question-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-total-tokens", type=int, default=6144, help="each server's device pool")
    args = parser.parse_args()
    convs = workload(args)
    distinct = args.system_len + args.groups * args.document_len
    distinct += len(convs) * args.turns * (args.question_len + args.output_len + 16)
    print(f"CPU: {cpu_name()}; 2 servers x {args.max_total_tokens} device tokens; about {distinct} distinct tokens")
    print(f"{len(convs)} conversations x {args.turns} turns, {args.groups} groups, concurrency {args.concurrency}")
    serve = ["--model", "tiny", "--max-total-tokens", str(args.max_total_tokens)]
    servers = [ServerProcess([*serve, "--kv-events-endpoint", f"tcp://127.0.0.1:{free_ports(2)}"]) for _ in range(2)]
    for server in servers:
        server.start()
    try:
        rows = []
        for policy in POLICIES:
            flags = [f for s in servers for f in ("--server", s.url)] + ["--policy", policy]
            with ServerProcess(flags, command="router") as router:
                results = asyncio.run(run_arm(router.url, convs, args.concurrency))
            prompt = sum(r.prompt_tokens or 0 for r in results)
            cached = sum(r.cached_tokens or 0 for r in results)
            ttft = statistics.median(r.ttft_s for r in results if r.ttft_s is not None)
            rows.append((policy, len(results), cached / prompt, ttft))
        baseline = rows[POLICIES.index("round-robin")][3]
        print("| policy | requests | hit rate | median TTFT | TTFT vs round-robin |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for policy, n, hit, ttft in rows:
            print(f"| {policy} | {n} | {hit:.1%} | {ttft * 1000:.0f} ms | {ttft / baseline:.2f}x |")
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
