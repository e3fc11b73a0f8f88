"""P/D streaming (docs/DESIGN.md, "P/D streaming"; not a test): what a prefill server holds in host memory
while a request's suffix crosses to decode, and the request's end-to-end time, against one message
holding the whole suffix (what staging it whole held) measured in the same run.

Two in-process prefill engines (tiny) send to one decode engine over ZeroMQ on loopback: one with
`--disaggregation-transfer-chunk-pages 4` (64 tokens, 128 KiB of float32 KV a message), one with
chunks of 256 pages (4,096 tokens: every prompt here crosses in one message). For each prompt length,
the best of `--reps` end-to-end times of one request (prefill, transfer, one decode step) and the
prefill's `peak_staged_bytes` (a running maximum: prompts grow, so it is the peak at that length).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/pd_streaming.py [--reps 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_name  # noqa: E402
from hicache import SamplingParams  # noqa: E402
from tests.disagg.pd import PDPair, decode_engine, free_ports, prefill_engine, scheduler_of  # noqa: E402

LENGTHS = (1024, 2048, 3968)  # tiny has 4,096 positions
CHUNKED_PAGES, WHOLE_PAGES = 4, 256
PARAMS = SamplingParams(max_new_tokens=1, ignore_eos=True)


def best_end_to_end(pair: PDPair, prompt: list[int], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        (turn,) = pair.run([prompt], PARAMS)
        best = min(best, time.perf_counter() - start)
        if turn.decode.error is not None:
            raise RuntimeError(turn.decode.error)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    decode = decode_engine(reuse=False)
    base = free_ports(2)
    ports = [base, base + 1]
    prefills = [prefill_engine(port, disaggregation_transfer_chunk_pages=pages)
                for port, pages in zip(ports, (CHUNKED_PAGES, WHOLE_PAGES))]  # fmt: skip
    pairs = [PDPair(prefill, decode, port) for prefill, port in zip(prefills, ports)]
    try:
        per_token = decode.call_in_loop(lambda: scheduler_of(decode).runner.pool.bytes_per_token)
        print(f"CPU: {cpu_name()}; KV {per_token} B a token; chunk {CHUNKED_PAGES} pages vs {WHOLE_PAGES} pages")
        print("| prompt | suffix KV | staged at once, 4-page chunks | staged, one message | time, chunks | "
              "time, one message | ratio |")
        rng = random.Random(22)
        for tokens in LENGTHS:
            prompt = [rng.randrange(32, 127) for _ in range(tokens)]
            times = [best_end_to_end(pair, prompt, args.reps) for pair in pairs]
            peaks = [prefill.disagg_stats().peak_staged_bytes for prefill in prefills]
            print(f"| {tokens} | {tokens * per_token / 2**20:.2f} MiB | {peaks[0] / 2**10:.0f} KiB | "
                  f"{peaks[1] / 2**20:.2f} MiB | {times[0] * 1e3:.0f} ms | {times[1] * 1e3:.0f} ms | "
                  f"{times[0] / times[1]:.2f} |")
    finally:
        for engine in (*prefills, decode):
            engine.shutdown()


if __name__ == "__main__":
    main()
