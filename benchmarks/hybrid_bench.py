"""`tiny-hybrid` (docs/DESIGN.md, "Hybrid models") against `tiny`, the Llama of the same size, each with its
cache off and on, measured in the same run: what a multi-turn workload's cached prefixes save a hybrid,
what a decode step pays for the recurrent scan, and what a cached prefix holds in device memory.

    .venv/bin/python benchmarks/hybrid_bench.py [--convs 4] [--system 1024] [--question 64] [--turns 4] [--new 16]
        [--memory-only] [--swa-ratios 1 0.25 0.125]

Workload: `--convs` conversations in two groups sharing a `--system`-token system prompt, each turn adding
a `--question`-token question to the whole history (token ids, not text), all conversations' turns
submitted together; greedy, `--new` tokens a turn. Per arm: hit rate (cached / prompt tokens over turns
2..), mean TTFT over turns 2.. and its ratio to the same model's cache-off arm, and decode ms per token
(latency - TTFT over the tokens after the first). Arms run one after another, so load from other jobs
is not shared alike: the ratios within a model are what to read. Memory: the pool's bytes per token, and
the device bytes a 32K-token prefix holds while its request runs and once cached (measured, `--memory-only`
for that alone).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import cpu_name  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402

PREFIX = 32768
POOL = 16384  # the workload arms' device pool, in tokens (16-token pages)


def workload(convs: int, system: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32, 127) for _ in range(system)] for _ in range(2)]
    return [list(systems[c % 2]) for c in range(convs)]


def run_arm(model: str, cache: bool, args, ratio: float = 1.0) -> dict[str, float]:
    histories, rng = workload(args.convs, args.system), random.Random(1)
    params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    cached = prompt = 0
    ttfts, decode_ms = [], []
    with Engine(model=model, disable_radix_cache=not cache, max_total_tokens=POOL,
                swa_full_tokens_ratio=ratio) as engine:  # fmt: skip
        for turn in range(args.turns):
            for h in histories:
                h.extend(rng.randrange(32, 127) for _ in range(args.question))
            results = engine.generate([list(h) for h in histories], params)
            for h, r in zip(histories, results):
                h.extend(r.token_ids)
                decode_ms.append(1000 * (r.latency_s - r.ttft_s) / (args.new - 1))
                if turn:
                    cached, prompt = cached + r.cached_tokens, prompt + r.prompt_tokens
                    ttfts.append(r.ttft_s)
        sliding = engine.call_in_loop(lambda: engine._runtime.scheduler.cache.device.sliding) if cache else None
    counts = {} if sliding is None else {
        "shrunk_hits": sliding.shrunk_hits, "shrunk_pages": sliding.shrunk_pages, "evicted": sliding.evicted,
        "freed_at_release": sliding.freed_at_release,
    }  # fmt: skip
    return {"hit_rate": cached / prompt, "ttft_ms": 1000 * statistics.mean(ttfts),
            "decode_ms": statistics.median(decode_ms), **counts}  # fmt: skip


def sliding_arms(args) -> None:
    """tiny-hybrid with its cache on, one arm per sliding-window pool size (`--swa-ratios`): what the
    sliding pool's eviction and the match rule cost the workload's hits."""
    print("| --swa-full-tokens-ratio | sliding pages | hit rate (turns 2..) | mean TTFT (turns 2..) | shrunk hits "
          "(pages lost) | sliding pages evicted | freed at release |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for ratio in args.swa_ratios:
        arm = run_arm("tiny-hybrid", True, args, ratio)
        print(f"| {ratio} | {int(POOL // 16 * ratio)} | {arm['hit_rate']:.0%} | {arm['ttft_ms']:.1f} ms | "
              f"{arm['shrunk_hits']} ({arm['shrunk_pages']}) | {arm['evicted']} | {arm['freed_at_release']} |")


def memory() -> None:
    for name in ("tiny", "tiny-hybrid"):
        with Engine(model=name, max_total_tokens=PREFIX + 256) as engine:
            pool = engine._runtime.scheduler.runner.pool
            running, cached = engine.call_in_loop(lambda: cached_prefix_bytes(engine._runtime.scheduler.cache))
        print(f"{name}: row {pool.layout.describe()}, {pool.bytes_per_token} B/token, {pool.num_layers} layers, "
              f"sliding layers {sorted(pool.sliding_layers)}; a {PREFIX}-token prefix on the device: "
              f"{running / 2**20:.1f} MiB while its request holds it, {cached / 2**20:.1f} MiB cached after it")


def cached_prefix_bytes(cache) -> tuple[int, int]:
    """Device bytes (measured: the pool's resident bytes) of a PREFIX-token prompt while its request holds
    its pages, every layer's KV of every token, and once the request ended and the tree caches it. Run on
    the scheduler thread through the cache API; no forward pass, since the bytes held do not depend on the
    values (the pages are allocated and cached exactly as a served request's are)."""
    tokens = [random.Random(2).randrange(32, 127) for _ in range(PREFIX)]
    handle = cache.open(-1, tokens, "")
    assert cache.admit(handle, -(-PREFIX // handle.page_size)).admitted
    cache.extend(handle, PREFIX)
    handle.advance(PREFIX)
    running = cache.resident_bytes()["device"]
    cache.release(handle, tokens)
    return running, cache.resident_bytes()["device"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--convs", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--swa-ratios", type=float, nargs="*", help="only tiny-hybrid, one arm per sliding pool")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; {vars(args)}")
    if args.memory_only:
        memory()
        return
    if args.swa_ratios:
        sliding_arms(args)
        return
    print("| model | cache | hit rate (turns 2..) | mean TTFT (turns 2..) | vs cache off | decode ms/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in ("tiny", "tiny-hybrid"):
        off = run_arm(model, False, args)
        on = run_arm(model, True, args)
        for label, arm in (("off", off), ("device", on)):
            print(f"| {model} | {label} | {arm['hit_rate']:.0%} | {arm['ttft_ms']:.1f} ms | "
                  f"{arm['ttft_ms'] / off['ttft_ms']:.2f}x | {arm['decode_ms']:.2f} |")  # fmt: skip
    memory()


if __name__ == "__main__":
    main()
