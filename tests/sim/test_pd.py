"""A simulated P/D pair against a real one (in-process engines over the real ZeroMQ transport,
tests/disagg/pd.py): the same trace and configurations give the same hits request by request: prefill's
cached tokens by tier, decode's own prefix by tier (its `decode_prefix_len`) and the tokens transferred,
with decode reuse off and on (device + host, a decode pool below the working set)."""

import dataclasses

import numpy as np
import pytest

from hicache import Engine, SamplingParams
from hicache.cli import main
from hicache.config import DisaggConfig, EngineConfig, HiCacheConfig
from hicache.sim.cost import load_cost_model
from hicache.sim.pd import PDSimulator
from hicache.sim.trace import TraceRequest, answer_tokens
from tests.disagg.pd import PDPair, free_ports

PAGE = 16
NEW = 4  # output tokens: prompts are page multiples, so no output fills a page the tree would keep
VOCAB = 258  # tiny's
HOST = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0)


def _prompts() -> list[list[int]]:
    """Three rounds over 4 conversations in 2 groups: a group's 256-token system prompt, then the
    conversation's own 64 tokens, 64 more each round; groups interleave."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(0, VOCAB, 256).tolist() for _ in range(2)]
    own = [rng.integers(0, VOCAB, 192).tolist() for _ in range(4)]
    return [systems[c % 2] + own[c][: 64 + 64 * rnd] for rnd in range(3) for c in range(4)]


PROMPTS = _prompts()
# Prefill: its pool below the working set (2 x 256 shared + 4 x 192 own = 1,280 tokens), a host tier
# behind it. Decode: its pool holds about two prompts, so with reuse on its host serves the rest.
PREFILL = EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=1024, hicache=HOST,
                       disagg=DisaggConfig(disaggregation_mode="prefill"))  # fmt: skip
DECODE_OFF = EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=1024,
                          disagg=DisaggConfig(disaggregation_mode="decode"))  # fmt: skip
DECODE_ON = dataclasses.replace(DECODE_OFF, hicache=HOST, disagg=DisaggConfig(
    disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True))  # fmt: skip


def _real(decode_cfg: EngineConfig) -> list[tuple[dict[str, int], dict[str, int], int]]:
    port = free_ports(1)
    prefill_cfg = dataclasses.replace(PREFILL, disagg=dataclasses.replace(PREFILL.disagg,
                                      disaggregation_bootstrap_port=port))  # fmt: skip
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    with Engine(prefill_cfg) as prefill, Engine(decode_cfg) as decode:
        pair = PDPair(prefill, decode, port)
        turns = [pair.run([p], params)[0] for p in PROMPTS]  # one at a time, as the simulated trace
    return [(t.decode.cached_tokens_by_tier, t.decode.disagg.decode_prefix_by_tier, t.transferred_tokens)
            for t in turns]  # fmt: skip


def _simulated(decode_cfg: EngineConfig) -> list[tuple[dict[str, int], dict[str, int], int]]:
    trace = [TraceRequest(i, i % 2, i // 4, 10.0 * i, (lambda p=p: list(p)), answer_tokens(i, NEW, VOCAB))
             for i, p in enumerate(PROMPTS)]  # fmt: skip
    simulator = PDSimulator(PREFILL, decode_cfg, load_cost_model("epyc-2core-tiny"))
    try:
        records = simulator.run(trace)
    finally:
        simulator.shutdown()
    assert all(r.error is None for r in records), [r.error for r in records]
    return [(r.cached_tokens_by_tier, prefix, r.transferred_tokens)
            for r, prefix in zip(records, simulator.decode_prefixes)]  # fmt: skip


@pytest.mark.parametrize("decode_cfg", [DECODE_OFF, DECODE_ON], ids=["decode reuse off", "decode reuse on"])
def test_a_simulated_pd_pair_hits_as_the_real_one_request_by_request(decode_cfg):
    real, simulated = _real(decode_cfg), _simulated(decode_cfg)
    assert simulated == real
    prefill_host = sum(hits["host"] for hits, _, _ in real)
    decode_tiers = {tier: sum(prefix[tier] for _, prefix, _ in real) for tier in ("device", "host")}
    transferred = sum(n for _, _, n in real)
    # The trace must exercise what it compares: prefill's host tier serves some of its hits; with reuse
    # off every prompt crosses whole, with it on decode serves prefixes from both of its tiers.
    assert prefill_host > 0, real
    if decode_cfg is DECODE_OFF:
        assert transferred == sum(map(len, PROMPTS)) and decode_tiers == {"device": 0, "host": 0}, real
    else:
        assert decode_tiers["device"] > 0 and decode_tiers["host"] > 0, real
        assert transferred == sum(map(len, PROMPTS)) - sum(decode_tiers.values()), real


def test_decode_reuse_moves_fewer_bytes_over_the_simulated_nic():
    """The NIC carries the suffix after decode's prefix only: its bytes are the tokens transferred."""
    kv_bytes = load_cost_model("epyc-2core-tiny").kv_bytes_per_token
    moved = {}
    for name, decode_cfg in (("off", DECODE_OFF), ("on", DECODE_ON)):
        simulator = PDSimulator(PREFILL, decode_cfg, load_cost_model("epyc-2core-tiny"))
        try:
            records = simulator.run([TraceRequest(i, 0, i, 10.0 * i, (lambda p=p: list(p)),
                                                  answer_tokens(i, NEW, VOCAB)) for i, p in enumerate(PROMPTS)])
        finally:
            simulator.shutdown()
        moved[name] = simulator.bytes_moved()["prefill->decode (NIC)"]
        assert moved[name] == kv_bytes * sum(r.transferred_tokens for r in records)
    assert moved["on"] < moved["off"] == kv_bytes * sum(map(len, PROMPTS)), moved


def test_simulate_pd_decode_runs_a_pair_from_the_command_line(capsys):
    """`--pd-decode FLAGS`: the command's flags are prefill's, FLAGS decode's. With decode reuse on, a second
    turn's prefix is decode's own: exactly those tokens cross no more, against the same trace without it."""
    argv = ["simulate", "--model", "tiny", "--gsp-num-groups", "1", "--gsp-prompts-per-group", "2", "--gsp-num-turns",
            "2", "--gsp-system-prompt-len", "256", "--gsp-question-len", "64", "--gsp-output-len", "16"]  # fmt: skip
    transferred, prefix = {}, {}
    for reuse in ("", "--disaggregation-decode-enable-radix-cache"):
        assert main([*argv, f"--pd-decode={reuse}"]) == 0
        out = capsys.readouterr().out
        rows = {cells[0]: cells[1] for cells in (line.strip("| ").split(" | ") for line in out.splitlines()
                if line.startswith("| "))}  # fmt: skip
        assert rows["requests completed"] == "4", out
        transferred[reuse] = int(rows["P/D: prompt tokens transferred"])
        line = next(line for line in out.splitlines() if line.startswith("decode's own prefix"))
        prefix[reuse] = int(line.split(": ")[1].split(" tokens")[0].replace(",", ""))
    off, on = "", "--disaggregation-decode-enable-radix-cache"
    assert prefix[off] == 0 < prefix[on], prefix
    assert transferred[off] - transferred[on] == prefix[on], (transferred, prefix)
