"""`tiny-hybrid` (docs/DESIGN.md, "Hybrid models") against `tiny`, the Llama of the same size, each with its
cache off and on, measured in the same run: what a multi-turn workload's cached prefixes save a hybrid,
what a decode step pays for the recurrent scan, and what a cached prefix holds in device memory.

    .venv/bin/python benchmarks/hybrid_bench.py [--convs 4] [--system 1024] [--question 64] [--turns 4] [--new 16]
        [--memory-only] [--swa-ratios 1 0.25 0.125] [--track-intervals 16 64 256 0]

Workload: `--convs` conversations in two groups sharing a `--system`-token system prompt, each turn adding
a `--question`-token question to the whole history (token ids, not text), all conversations' turns
submitted together (`--stagger`: a group's k-th conversation joins at turn k; `--host`: the host tier under
the device); greedy, `--new` tokens a turn. Per arm: hit rate (cached / prompt tokens over turns
2..), mean TTFT over turns 2.. and its ratio to the same model's cache-off arm, and decode ms per token
(latency - TTFT over the tokens after the first). Arms run one after another, so load from other jobs
is not shared alike: the ratios within a model are what to read. Memory: the pool's bytes per token, and
the device bytes a 32K-token prefix holds while its request runs and once cached (measured, `--memory-only`
for that alone). `--track-intervals`: tiny-hybrid's cache under each `--mamba-track-interval` (where its
recurrent-state snapshots are kept, so where a hit may end; 0: a turn's end) against its cache off, and the
bytes a snapshot would cost a real hybrid under each (computed from its config, not measured).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import cpu_name  # noqa: E402
from hicache import Engine, SamplingParams  # noqa: E402
from hicache.config import HiCacheConfig  # noqa: E402

PREFIX = 32768
POOL = 16384  # the workload arms' device pool, in tokens (16-token pages)


def workload(convs: int, system: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32, 127) for _ in range(system)] for _ in range(2)]
    return [list(systems[c % 2]) for c in range(convs)]


# Qwen3-Next-80B-A3B's shape (its config.json): 48 layers, every 4th full attention (2 KV heads of 256), the
# other 36 Gated DeltaNet layers (32 value heads, 16 key heads, head dims 128, a causal conv of kernel 4).
REAL_HYBRID = {"name": "Qwen3-Next-80B-A3B", "full_layers": 12, "kv_heads": 2, "head_dim": 256, "linear_layers": 36,
               "value_heads": 32, "key_heads": 16, "linear_head_dim": 128, "conv_kernel": 4, "bytes": 2}


def snapshot_costs(page: int, intervals: list[int]) -> None:
    """Computed: a real hybrid's state snapshot (every linear layer's recurrent state and conv tail, in
    bf16) against its KV per page, and what each interval's snapshots add per page of prefix."""
    r = REAL_HYBRID
    state = r["value_heads"] * r["linear_head_dim"] ** 2
    conv = (r["conv_kernel"] - 1) * (2 * r["key_heads"] + r["value_heads"]) * r["linear_head_dim"]
    snapshot = r["linear_layers"] * (state + conv) * r["bytes"]
    kv_page = r["full_layers"] * 2 * r["kv_heads"] * r["head_dim"] * r["bytes"] * page
    print(f"computed, {r['name']} in bf16: a snapshot {snapshot / 2**20:.1f} MiB ({r['linear_layers']} layers x "
          f"{(state + conv) * r['bytes'] / 2**20:.2f} MiB), a {page}-token page's KV {kv_page / 2**10:.0f} KiB: "
          f"one snapshot = {snapshot / kv_page:.0f} pages' KV")
    for interval in intervals:
        label = "a turn's end" if interval == 0 else f"every {interval} tokens"
        per_page = (f"one a turn, whatever its length ({snapshot / kv_page:.0f} pages' KV)" if interval == 0
                    else f"{snapshot / (interval // page) / kv_page:.2f}x the KV")  # fmt: skip
        print(f"  {label}: snapshot bytes per cached page {per_page}")


def run_arm(model: str, cache: bool, args, ratio: float = 1.0, interval: int | None = None) -> dict[str, float]:
    histories, rng = workload(args.convs, args.system), random.Random(1)
    params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    cached = prompt = 0
    ttfts, decode_ms = [], []
    # --stagger: a group's k-th conversation (conversation c is the c // 2-th of group c % 2) joins at turn k,
    # after that turn's other requests ended, so it branches off the system prompt its group cached.
    joins = [c // 2 if args.stagger else 0 for c in range(args.convs)]
    host = HiCacheConfig(enable_hierarchical_cache=cache and args.host)
    with Engine(model=model, disable_radix_cache=not cache, max_total_tokens=POOL, swa_full_tokens_ratio=ratio,
                mamba_track_interval=interval, hicache=host) as engine:  # fmt: skip
        for turn in range(args.turns):
            active = [h for c, h in enumerate(histories) if turn > joins[c]]
            joining = [h for c, h in enumerate(histories) if turn == joins[c]]
            for h in active + joining:
                h.extend(rng.randrange(32, 127) for _ in range(args.question))
            results = [r for batch in (active, joining) if batch
                       for r in engine.generate([list(h) for h in batch], params)]  # fmt: skip
            for h, r in zip(active + joining, results):
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


def policy_arms(args) -> None:
    """tiny-hybrid with its cache off, then on under each snapshot policy (`--track-intervals`)."""
    off = run_arm("tiny-hybrid", False, args)
    arms = {interval: run_arm("tiny-hybrid", True, args, interval=interval) for interval in args.track_intervals}
    every_page = arms.get(16)
    print("| --mamba-track-interval | hit rate (turns 2..) | mean TTFT (turns 2..) | vs cache off | vs every page |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| cache off | 0% | {off['ttft_ms']:.1f} ms | 1.00x | |")
    for interval, arm in arms.items():
        versus = f"{arm['ttft_ms'] / every_page['ttft_ms']:.2f}x" if every_page else ""
        print(f"| {interval or 'turn end (0)'} | {arm['hit_rate']:.1%} | {arm['ttft_ms']:.1f} ms | "
              f"{arm['ttft_ms'] / off['ttft_ms']:.2f}x | {versus} |")
    snapshot_costs(16, args.track_intervals)


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
    parser.add_argument("--track-intervals", type=int, nargs="*", help="only tiny-hybrid, one arm per snapshot policy")
    parser.add_argument("--stagger", action="store_true", help="a group's k-th conversation joins at turn k")
    parser.add_argument("--host", action="store_true", help="the cache-on arms with the host tier")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; {vars(args)}")
    if args.memory_only:
        memory()
        return
    if args.swa_ratios:
        sliding_arms(args)
        return
    if args.track_intervals:
        policy_arms(args)
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
