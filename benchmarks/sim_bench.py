"""How long `hicache simulate` takes for a large trace (docs/DESIGN.md, "capacity simulator"; issue 26:
thousands of 100K-token requests in minutes on this machine).

    PYTHONPATH=. .venv/bin/python benchmarks/sim_bench.py [--requests 1000] [--tokens 100000]

Writes a Mooncake-shaped trace: `--groups` documents of `--tokens` tokens, each request one document's
shared first 3/4 then blocks of its own, arriving every `--gap-ms`, and runs it through `hicache simulate`
with the H100 node preset (device pool of 1M tokens, 64-token pages, host tier of 2 TB). Prints the
wall time, the virtual time it simulated, and their ratio (the baseline measured in the same run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import tempfile
import time

from hicache.cli import main
from hicache.sim.trace import MOONCAKE_BLOCK_TOKENS


def write_trace(path: pathlib.Path, requests: int, tokens: int, groups: int, gap_ms: float) -> None:
    blocks = -(-tokens // MOONCAKE_BLOCK_TOKENS)
    shared = blocks * 3 // 4
    with open(path, "w", encoding="utf-8") as f:
        for i in range(requests):
            group = i % groups
            own = [10_000_000 + i * blocks + b for b in range(blocks - shared)]
            hash_ids = [group * blocks + b for b in range(shared)] + own
            row = {"timestamp": i * gap_ms, "input_length": tokens, "output_length": 64, "hash_ids": hash_ids}
            f.write(json.dumps(row) + "\n")


def main_bench() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=4000.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = pathlib.Path(tmp) / "trace.jsonl"
        write_trace(trace, args.requests, args.tokens, args.groups, args.gap_ms)
        out = io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(out):
            rc = main([
                "simulate", "--model", "tiny", "--cost-model", "h100x8-llama70b", "--trace", str(trace),
                "--page-size", "64", "--max-total-tokens", str(2**20), "--chunked-prefill-size", "8192",
                "--enable-hierarchical-cache", "--hicache-size", "2000",
            ])  # fmt: skip
        wall_s = time.perf_counter() - started
    text = out.getvalue()
    print(text)
    assert rc == 0, rc
    virtual_s = float(text.rsplit("requests, ", 1)[1].split(" s of virtual time")[0])
    print(f"wall {wall_s:.1f} s for {args.requests} requests of {args.tokens} tokens; "
          f"{virtual_s:.1f} s simulated: {virtual_s / wall_s:.1f}x real time")  # fmt: skip


if __name__ == "__main__":
    main_bench()
