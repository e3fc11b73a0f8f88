"""Does `hicache simulate` predict this machine? (docs/DESIGN.md, "capacity simulator"; issue 26.)

    PYTHONPATH=. .venv/bin/python benchmarks/sim_validate.py [--cost-model epyc-2core-tiny]

One small trace (3 groups sharing a system prompt, 2 conversations each, 2 turns, one request at a time)
through the real `tiny` engine and through the simulator, with the preset and with a cost model
calibrated at the start of the run (`hicache simulate --calibrate`), in three configurations:
the device pool below the working set; device + host; device + host + a file store, measured on a
second server started on the first one's store (a restart). Prints, side by side, each tier's share of
the prompt tokens and the median TTFT, with the prediction's error against the real run measured in
the same run (the baseline). tests/sim/test_simulate.py pins the hits request by request; this reports
how far the cost model's times are.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

import numpy as np

from hicache import Engine, SamplingParams
from hicache.config import EngineConfig, HiCacheConfig
from hicache.sim.calibrate import calibrate
from hicache.sim.cost import CostModel, load_cost_model
from hicache.sim.simulator import Simulator
from hicache.sim.trace import TraceRequest, answer_tokens

PAGE = 16
VOCAB = 258  # tiny's
NEW = 4  # prompts are page multiples, so no output fills a page the tree would keep
SYSTEM, OWN, FOLLOW_UP = 1024, 512, 256
DEVICE_TOKENS = 5120  # below the working set (3 x 1024 shared + 6 x 768 own = 7,680 tokens)
HOST = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0)
# name: (the cache, servers run one after another on the same store; the last one is measured)
CONFIGS = {
    "device only": (HiCacheConfig(), 1),
    "device + host": (HOST, 1),
    "+ file store, restarted": (dataclasses.replace(HOST, hicache_storage_backend="file"), 2),
}
TIERS = ("device", "host", "storage")


def prompts() -> list[list[int]]:
    """Turn 0 of the 6 conversations, then turn 1 (the same plus a follow-up); groups interleave."""
    rng = np.random.default_rng(11)
    systems = [rng.integers(0, VOCAB, SYSTEM).tolist() for _ in range(3)]
    own = [rng.integers(0, VOCAB, OWN + FOLLOW_UP).tolist() for _ in range(6)]
    return [systems[c % 3] + own[c][: OWN + FOLLOW_UP * rnd] for rnd in range(2) for c in range(6)]


def real_run(hc: HiCacheConfig, trace: list[list[int]]) -> list[tuple[dict[str, int], float]]:
    with Engine(model="tiny", page_size=PAGE, max_total_tokens=DEVICE_TOKENS, hicache=hc) as engine:
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        results = [engine.submit(p, params).result() for p in trace]
    return [(r.cached_tokens_by_tier, r.ttft_s) for r in results]


def simulated_run(hc: HiCacheConfig, trace: list[list[int]], cost: CostModel) -> list[tuple[dict[str, int], float]]:
    requests = [
        TraceRequest(i, i % 3, i // 6, 100.0 * i, (lambda p=p: list(p)), answer_tokens(i, NEW, VOCAB))
        for i, p in enumerate(trace)
    ]  # fmt: skip
    cfg = EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=DEVICE_TOKENS, hicache=hc)
    simulator = Simulator(cfg, cost)
    try:
        return [(r.cached_tokens_by_tier, r.ttft_s) for r in simulator.run(requests)]
    finally:
        simulator.shutdown()


def measured(run, hc: HiCacheConfig, servers: int) -> list[tuple[dict[str, int], float]]:  # noqa: ANN001
    with tempfile.TemporaryDirectory() as store:
        hc = dataclasses.replace(hc, hicache_storage_dir=store)
        return [run(hc) for _ in range(servers)][-1]


def shares(results: list[tuple[dict[str, int], float]], prompt_tokens: int) -> list[float]:
    return [100 * sum(tiers[t] for tiers, _ in results) / prompt_tokens for t in TIERS]


def main_bench() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cost-model", default="epyc-2core-tiny")
    args = parser.parse_args()
    preset = load_cost_model(args.cost_model)
    calibrated = calibrate(EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=8192), preset, "calibrated")
    c = calibrated.compute
    print(f"calibrated: step {1000 * c.step_overhead_s:.2f} ms + {1000 * c.decode_s_per_request:.3f} ms a decoding "
          f"request, GEMMs {c.flops / 1e9:.2f} GFLOP/s, attention {c.attention_flops / 1e9:.2f} GFLOP/s\n")  # fmt: skip
    trace = prompts()
    prompt_tokens = sum(len(p) for p in trace)
    print("| configuration | hits device / host / storage, real | simulated | largest gap | median TTFT real "
          f"| simulated, {preset.name} (error) | simulated, calibrated (error) |")  # fmt: skip
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name, (hc, servers) in CONFIGS.items():
        real = measured(lambda c: real_run(c, trace), hc, servers)
        predicted = [measured(lambda c: simulated_run(c, trace, cost), hc, servers) for cost in (preset, calibrated)]
        real_shares, simulated_shares = shares(real, prompt_tokens), shares(predicted[1], prompt_tokens)
        gap = max(abs(a - b) for a, b in zip(real_shares, simulated_shares))
        real_ttft = statistics.median(t for _, t in real)
        cells = []
        for results in predicted:
            ttft = statistics.median(t for _, t in results)
            cells.append(f"{1000 * ttft:.1f} ms ({100 * (ttft - real_ttft) / real_ttft:+.0f}%)")
        print(f"| {name} | {' / '.join(f'{s:.1f}%' for s in real_shares)} | "
              f"{' / '.join(f'{s:.1f}%' for s in simulated_shares)} | {gap:.1f} points | {1000 * real_ttft:.1f} ms "
              f"| {' | '.join(cells)} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main_bench()
