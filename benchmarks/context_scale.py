"""Context scale (issue 22): what a new turn and a decode step cost as the cached history grows.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/context_scale.py \\
        [--model tiny] [--histories 1024 4096 16384 65536 131072] [--turn 1024] [--decode-steps 16] \\
        [--decode-only]

Per history length H, in one engine with host memory and a file store behind a device pool that holds
one conversation (H + turn + decode tokens) and little more:
  1. the history is prefilled (it is written through to host and store);
  2. **cold**: a turn of H + turn tokens sharing nothing with it: its TTFT is the cold prefill of the
     whole, and it pushes the history out of the device pool onto host;
  3. **host**: the history plus a new turn: the history comes back from host;
  4. **device**: the history plus another new turn, then decoded: the history is on device now, and its
     decode steps run over H + turn keys with no copy to or from host beside them;
  5. **storage**: a fresh engine on the same store (a restart) serves the history plus a third turn.
Each arm's cached tokens by tier are printed beside its TTFT, so a figure that is not the arm it says
(a miss where a hit was meant) shows. Decode is set against the KV-read limit: the KV bytes a step
attends over divided by the memcpy bandwidth measured in the same run (bytes copied per second). The
extra memory of a decode step is the largest rise of the process's resident memory over what it held
at the first token, sampled every millisecond while the steps run; large allocations are returned to
the system at once (MALLOC_MMAP_THRESHOLD_, set before torch loads), so resident memory follows what
is allocated.
"""

from __future__ import annotations

import os
import sys

# Before anything allocates: glibc returns blocks of 64 KiB and more to the system when freed, so the
# resident size sampled below rises and falls with what a step allocates. (Run as a script only: a test
# that imports this module measures with its own process's allocator.)
if __name__ == "__main__" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import argparse
import tempfile
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import cpu_name, memcpy_gbps
from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig

HISTORIES = (1024, 4096, 16384, 65536, 131072)
PAGE = 16
RSS_PERIOD_S = 0.001


def tokens(n: int, salt: int, vocab: int) -> list[int]:
    """n token ids, different for each salt from the first token on (no shared prefix between salts)."""
    return [(i * 7919 + salt * 104729 + salt) % (vocab - 2) + 1 for i in range(n)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Resident memory sampled in a thread; `peak_since(t)` is the most it held from time t on."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), rss_bytes()))
            time.sleep(RSS_PERIOD_S)

    def at(self, t: float) -> int:
        before = [rss for when, rss in self.samples if when <= t]
        return before[-1] if before else self.samples[0][1]

    def peak_since(self, t: float) -> int:
        return max((rss for when, rss in self.samples if when >= t), default=0)


@dataclass
class Arm:
    ttft_s: float
    cached: dict[str, int]


@dataclass
class Row:
    history: int
    arms: dict[str, Arm]
    decode_step_s: float
    kv_bytes_per_step: int
    step_extra_bytes: int


def kv_bytes_per_token(engine: Engine) -> int:
    """Bytes of KV one token holds over all layers (K and V of every KV head, in the pool's dtype; GQA
    models: an MLA model's latent row is smaller)."""
    c = engine.model_config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * engine.config.resolved_dtype().itemsize


def measure_history(model: str, history: int, turn: int, steps: int, store: str, decode_only: bool = False) -> Row:
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    conversation = history + turn + steps
    flags = dict(
        model=model,
        context_length=max(4096, -(-(conversation + PAGE) // 4096) * 4096),
        # One conversation and a few pages: the cold turn must push the history out to host.
        max_total_tokens=-(-conversation // PAGE) * PAGE + 4 * PAGE,
        # Decode only: no host or store, so no write-through of the history runs beside the steps.
        hicache=HiCacheConfig() if decode_only else HiCacheConfig(
            enable_hierarchical_cache=True,
            hicache_ratio=3.0,
            hicache_storage_backend="file",
            hicache_storage_dir=store,
            hicache_storage_prefetch_policy="wait_complete",
        ),
    )
    arms: dict[str, Arm] = {}
    with Engine(**flags) as engine:
        vocab = engine.tokenizer.vocab_size
        past = tokens(history, 1, vocab)
        (r,) = engine.generate([past], one)
        arms["history"] = Arm(r.ttft_s, r.cached_tokens_by_tier)
        if not decode_only:
            (r,) = engine.generate([tokens(history + turn, 2, vocab)], one)
            arms["cold"] = Arm(r.ttft_s, r.cached_tokens_by_tier)
            (r,) = engine.generate([past + tokens(turn, 3, vocab)], one)
            arms["host"] = Arm(r.ttft_s, r.cached_tokens_by_tier)
        # Decode is measured on the device arm, once the evictions and backups the cold and host arms
        # started have settled: a step on the cold arm shared the cores with the history's copy to host,
        # and its memory counted the host pool's first touch of those pages.
        with RssSampler() as rss:
            decoding = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
            handle = engine.submit(past + tokens(turn, 4, vocab), decoding)
            result = handle.result()
            done = time.perf_counter()
        start = handle.first_token_at
        assert start is not None
        arms["device"] = Arm(result.ttft_s, result.cached_tokens_by_tier)
        decode_step_s = (done - start) / steps
        step_extra = rss.peak_since(start) - rss.at(start)
        kv_per_step = kv_bytes_per_token(engine) * (history + turn + steps // 2)
    if decode_only:
        return Row(history, arms, decode_step_s, kv_per_step, step_extra)
    with Engine(**flags) as engine:  # a restart: only the store remains
        (r,) = engine.generate([past + tokens(turn, 5, vocab)], one)
        arms["storage"] = Arm(r.ttft_s, r.cached_tokens_by_tier)
    return Row(history, arms, decode_step_s, kv_per_step, step_extra)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def print_table(rows: list[Row], model: str, turn: int, copy_gbps: float) -> None:
    print(f"\n{model}, a {turn}-token turn after a cached history; CPU: {cpu_name()}; memcpy {copy_gbps:.1f} GB/s\n")
    if all("cold" in r.arms for r in rows):
        print_turns(rows)
    print("\n| history | history prefill | decode step | KV read a step | KV-read limit | step / limit |"
          " step extra memory |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        limit = r.kv_bytes_per_step / (copy_gbps * 1e9)
        print(
            f"| {r.history} | {r.arms['history'].ttft_s:.3f} s | {r.decode_step_s * 1e3:.2f} ms"
            f" | {mib(r.kv_bytes_per_step)} MiB | {limit * 1e3:.3f} ms | {r.decode_step_s / limit:.1f}x"
            f" | {mib(r.step_extra_bytes)} MiB |"
        )


def print_turns(rows: list[Row]) -> None:
    print("| history | cold TTFT | device TTFT (x cold) | host TTFT (x cold) | storage TTFT (x cold) |"
          " hits device/host/storage |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        cold = r.arms["cold"].ttft_s
        cells = [f"{r.arms[a].ttft_s:.3f} s ({r.arms[a].ttft_s / cold:.3f})" for a in ("device", "host", "storage")]
        hits = " ".join(
            "/".join(str(r.arms[a].cached.get(t, 0)) for t in ("device", "host", "storage"))
            for a in ("device", "host", "storage")
        )
        print(f"| {r.history} | {cold:.3f} s | {' | '.join(cells)} | {hits} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--histories", type=int, nargs="+", default=list(HISTORIES))
    parser.add_argument("--turn", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--decode-only", action="store_true",
                        help="prefill each history once and decode after it: no cold, host or storage arm")  # fmt: skip
    args = parser.parse_args(argv)
    copy_gbps = memcpy_gbps()
    rows = []
    for history in args.histories:
        with tempfile.TemporaryDirectory(prefix="context-scale-") as store:
            rows.append(measure_history(args.model, history, args.turn, args.decode_steps, store, args.decode_only))
        print(f"history {history}: done", file=sys.stderr, flush=True)
    print_table(rows, args.model, args.turn, copy_gbps)


if __name__ == "__main__":
    main()
