"""Does `hicache simulate` predict this machine? (docs/DESIGN.md, "capacity simulator"; issue 26.)

    PYTHONPATH=. .venv/bin/python benchmarks/sim_validate.py [--cost-model epyc-2core-tiny]

One small trace (3 groups sharing a system prompt, 2 conversations each, 2 turns, one request at a time)
through the real `tiny` engine and through the simulator, with the preset and with a cost model
calibrated at the start of the run (`hicache simulate --calibrate`), in three configurations:
the device pool below the working set; device + host; device + host + a file store, measured on a
second server started on the first one's store (a restart); and a P/D pair (a prefill and a decode
engine in this process, the KV over the real ZeroMQ transport on loopback, as tests/disagg/pd.py runs
them) with decode reuse off and on (device + host), against hicache/sim/pd.py. Prints, side by side,
each tier's share of the prompt tokens (of a P/D pair: prefill's, then decode's own prefix) and the median
TTFT, with the prediction's error against the real run measured in the same run (the baseline).
tests/sim/test_simulate.py and test_pd.py pin the hits request by request; this reports how far the
cost model's times are.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

import numpy as np

from hicache import Engine, SamplingParams
from hicache.config import DisaggConfig, EngineConfig, HiCacheConfig
from hicache.engine.launch import free_port
from hicache.scheduler.request import Bootstrap
from hicache.sim.calibrate import calibrate
from hicache.sim.cost import CostModel, load_cost_model
from hicache.sim.pd import PDSimulator
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
# name: decode's cache (prefill's is HOST), for a P/D pair
PD_CONFIGS = {
    "P/D pair, decode reuse off": (HiCacheConfig(), DisaggConfig(disaggregation_mode="decode")),
    "P/D pair, decode reuse on (device + host)": (
        HOST, DisaggConfig(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True)),
}  # fmt: skip
# (prefill's cached tokens by tier, decode's own prefix by tier, TTFT) of each request
PDResult = tuple[dict[str, int], dict[str, int], float]


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


def requests(trace: list[list[int]]) -> list[TraceRequest]:
    """Far apart: one request at a time, as the real runs send them."""
    return [
        TraceRequest(i, i % 3, i // 6, 100.0 * i, (lambda p=p: list(p)), answer_tokens(i, NEW, VOCAB))
        for i, p in enumerate(trace)
    ]  # fmt: skip


def simulated_run(hc: HiCacheConfig, trace: list[list[int]], cost: CostModel) -> list[tuple[dict[str, int], float]]:
    cfg = EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=DEVICE_TOKENS, hicache=hc)
    simulator = Simulator(cfg, cost)
    try:
        return [(r.cached_tokens_by_tier, r.ttft_s) for r in simulator.run(requests(trace))]
    finally:
        simulator.shutdown()


def pd_configs(hc: HiCacheConfig, disagg: DisaggConfig, port: int) -> tuple[EngineConfig, EngineConfig]:
    prefill = EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=DEVICE_TOKENS, hicache=HOST,
                           disagg=DisaggConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=port))
    decode = EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=DEVICE_TOKENS, hicache=hc, disagg=disagg)
    return prefill, decode


def real_pd_run(hc: HiCacheConfig, disagg: DisaggConfig, trace: list[list[int]]) -> list[PDResult]:
    """One request at a time through both engines, as `hicache router` sends it: both halves at once."""
    port = free_port()
    prefill_cfg, decode_cfg = pd_configs(hc, disagg, port)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    results = []
    with Engine(prefill_cfg) as prefill, Engine(decode_cfg) as decode:
        for room, p in enumerate(trace):
            boot = Bootstrap("127.0.0.1", port, room)
            prefilled, decoded = prefill.submit(p, params, bootstrap=boot), decode.submit(p, params, bootstrap=boot)
            prefilled.result()
            r = decoded.result()
            results.append((r.cached_tokens_by_tier, r.disagg.decode_prefix_by_tier, r.ttft_s))
    return results


def simulated_pd_run(
    hc: HiCacheConfig, disagg: DisaggConfig, trace: list[list[int]], cost: CostModel
) -> list[PDResult]:
    simulator = PDSimulator(*pd_configs(hc, disagg, DisaggConfig().disaggregation_bootstrap_port), cost)  # unused
    try:
        records = simulator.run(requests(trace))
    finally:
        simulator.shutdown()
    return [(r.cached_tokens_by_tier, prefix, r.ttft_s) for r, prefix in zip(records, simulator.decode_prefixes)]


def measured(run, hc: HiCacheConfig, servers: int) -> list[tuple[dict[str, int], float]]:  # noqa: ANN001
    with tempfile.TemporaryDirectory() as store:
        if hc.hicache_storage_backend is not None:  # a store's directory, where there is a store
            hc = dataclasses.replace(hc, hicache_storage_dir=store)
        return [run(hc) for _ in range(servers)][-1]


def shares(results: list[tuple[dict[str, int], float]], prompt_tokens: int) -> list[float]:
    return [100 * sum(tiers[t] for tiers, _ in results) / prompt_tokens for t in TIERS]


def row(name: str, real_shares: list[float], simulated_shares: list[float], real_ttft: float,
        predicted_ttfts: list[float]) -> str:  # fmt: skip
    gap = max(abs(a - b) for a, b in zip(real_shares, simulated_shares))
    cells = [f"{1000 * t:.1f} ms ({100 * (t - real_ttft) / real_ttft:+.0f}%)" for t in predicted_ttfts]
    return (f"| {name} | {' / '.join(f'{s:.1f}%' for s in real_shares)} | "
            f"{' / '.join(f'{s:.1f}%' for s in simulated_shares)} | {gap:.1f} points | {1000 * real_ttft:.1f} ms "
            f"| {' | '.join(cells)} |")  # fmt: skip


def pd_shares(results: list[PDResult], prompt_tokens: int) -> list[float]:
    """Prefill's hits by tier, then decode's own prefix on its device and host."""
    prefill = [100 * sum(tiers[t] for tiers, _, _ in results) / prompt_tokens for t in TIERS]
    return prefill + [100 * sum(prefix[t] for _, prefix, _ in results) / prompt_tokens for t in TIERS[:2]]


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
        ttfts = [statistics.median(t for _, t in results) for results in predicted]
        print(row(name, shares(real, prompt_tokens), shares(predicted[1], prompt_tokens),
                  statistics.median(t for _, t in real), ttfts), flush=True)  # fmt: skip
    print("\nP/D: hits are prefill's device / host / storage, then decode's own prefix on its device / host")
    for name, (hc, disagg) in PD_CONFIGS.items():
        pd_real = real_pd_run(hc, disagg, trace)
        pd_predicted = [simulated_pd_run(hc, disagg, trace, cost) for cost in (preset, calibrated)]
        ttfts = [statistics.median(t for _, _, t in results) for results in pd_predicted]
        print(row(name, pd_shares(pd_real, prompt_tokens), pd_shares(pd_predicted[1], prompt_tokens),
                  statistics.median(t for _, _, t in pd_real), ttfts), flush=True)  # fmt: skip


if __name__ == "__main__":
    main_bench()
