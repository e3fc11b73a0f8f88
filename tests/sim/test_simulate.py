"""`hicache simulate` against the real engine: the same trace, the same cache configuration, the same
hits on every tier, request by request (with a file store, across a restart too); a Mooncake trace file
imports and runs; a bad cost model is one line and exit 2; a preset names the machine and dtype it
describes, and engine flags that run another dtype get one warning line."""

import dataclasses
import json
import logging

import numpy as np
import pytest

from hicache import Engine, SamplingParams
from hicache.cli import main
from hicache.config import EngineConfig, HiCacheConfig
from hicache.errors import UserError
from hicache.sim.calibrate import to_toml
from hicache.sim.cli import warn_of_another_dtype
from hicache.sim.cost import load_cost_model
from hicache.sim.simulator import Simulator
from hicache.sim.trace import TraceRequest, answer_tokens
from hicache.storage.codec import HEADER_SIZE

PAGE = 16
DEVICE_TOKENS = 1280  # below the trace's working set (3 x 256 shared + 6 x 128 own = 1536 tokens)
NEW = 4  # output tokens: prompts are page multiples, so no output fills a page the tree would keep
VOCAB = 258  # tiny's


def _prompts() -> list[list[int]]:
    """Two rounds over 6 conversations in 3 groups: a group's 256-token system prompt, then the
    conversation's own 96 tokens, then (round 1) 32 more; groups interleave, so LRU eviction decides."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(0, VOCAB, 256).tolist() for _ in range(3)]
    own = [rng.integers(0, VOCAB, 128).tolist() for _ in range(6)]
    return [systems[c % 3] + own[c][: 96 + 32 * rnd] for rnd in range(2) for c in range(6)]


PROMPTS = _prompts()


def _trace() -> list[TraceRequest]:
    # Far apart: one request at a time, as the engine below runs them.
    return [
        TraceRequest(i, i % 3, i // 6, 10.0 * i, (lambda p=p: list(p)), answer_tokens(i, NEW, VOCAB))
        for i, p in enumerate(PROMPTS)
    ]


HOST = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0)
STORE = dataclasses.replace(HOST, hicache_storage_backend="file")
# name: (the cache, how many servers run the trace one after another on the same store)
CONFIGS = {
    "device only": (HiCacheConfig(), 1),
    "device + host": (HOST, 1),
    "device + host + file store, restarted": (STORE, 2),
}


def _engine_hits(hc: HiCacheConfig) -> list[dict[str, int]]:
    with Engine(model="tiny", page_size=PAGE, max_total_tokens=DEVICE_TOKENS, hicache=hc) as engine:
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        return [engine.generate([p], params)[0].cached_tokens_by_tier for p in PROMPTS]


def _simulated_hits(hc: HiCacheConfig) -> list[dict[str, int]]:
    cfg = EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=DEVICE_TOKENS, hicache=hc)
    simulator = Simulator(cfg, load_cost_model("epyc-2core-tiny"))
    try:
        return [r.cached_tokens_by_tier for r in simulator.run(_trace())]
    finally:
        simulator.shutdown()


@pytest.fixture(scope="module", params=list(CONFIGS))
def both(request, tmp_path_factory):
    """(engine's, simulator's) cached tokens by tier, request by request, of every server in turn, for
    one configuration; engine and simulator each on a store of their own."""
    hc, servers = CONFIGS[request.param]
    real_store, simulated_store = (str(tmp_path_factory.mktemp(side)) for side in ("real", "simulated"))
    stored = hc.hicache_storage_backend is not None  # a store's directory, where there is a store
    real_hc = dataclasses.replace(hc, hicache_storage_dir=real_store) if stored else hc
    real = [hit for _ in range(servers) for hit in _engine_hits(real_hc)]
    simulated_hc = dataclasses.replace(hc, hicache_storage_dir=simulated_store) if stored else hc
    simulated = [hit for _ in range(servers) for hit in _simulated_hits(simulated_hc)]
    return request.param, real, simulated


def test_simulated_hits_equal_the_engines_request_by_request(both):
    name, real, simulated = both
    assert simulated == real
    totals = {tier: sum(r[tier] for r in real) for tier in ("device", "host", "storage")}
    ideal = 3 * 256 + 6 * (256 + 96)  # round 0's later group members, then every conversation's first turn
    # The trace must exercise what it compares: the device pool alone loses hits to eviction, the host
    # tier serves them back, and a restarted server finds the first one's prompts in storage.
    if name == "device only":
        assert totals["host"] == 0 and 0 < totals["device"] < ideal, totals
    elif name == "device + host":
        assert totals["host"] > 0 and totals["storage"] == 0, totals
    else:
        restarted = {tier: sum(r[tier] for r in real[len(PROMPTS) :]) for tier in totals}
        assert restarted["storage"] > 0 and totals["storage"] == restarted["storage"], (totals, restarted)


def test_a_capped_store_keeps_as_many_pages_as_its_modelled_bytes_hold(tmp_path):
    """`--hicache-storage-max-bytes` counts the modelled KV's bytes (the cost model's), not the simulator's
    few-byte pages: a cap of 24 modelled pages keeps at most 24 objects. A cap a little below what the
    trace stores (90 of 96 pages) loses only the tails the restart does not ask for: the prefixes' first
    pages, put once and then served from memory, are touched with every later put below them, so a
    restarted server hits storage as on an uncapped store (it found nothing when the heads went first)."""
    envelope = HEADER_SIZE + load_cost_model("epyc-2core-tiny").kv_bytes_per_token * PAGE
    kept, restarted_hits = {}, {}
    for cap_pages in (0, 24, 90):
        store = tmp_path / str(cap_pages)
        hc = dataclasses.replace(STORE, hicache_storage_dir=str(store), hicache_storage_max_bytes=cap_pages * envelope)
        _simulated_hits(hc)
        kept[cap_pages] = len([f for f in store.rglob("*") if f.is_file() and not f.name.startswith(".")])
        restarted_hits[cap_pages] = sum(hit["storage"] for hit in _simulated_hits(hc))
    assert kept[24] <= 24 and kept[90] <= 90 < kept[0], kept
    assert restarted_hits[90] == restarted_hits[0] > 0, restarted_hits


def test_a_mooncake_trace_imports_and_runs(tmp_path, capsys):
    trace = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [11, 12]},
        {"timestamp": 5000, "input_length": 1536, "output_length": 8, "hash_ids": [11, 12, 13]},  # blocks 11, 12 hit
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["simulate", "--model", "tiny", "--max-total-tokens", "4096", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "| requests completed | 2 |" in out
    assert f"| hit rate | {100 * 1024 / (1024 + 1536):.1f}% |" in out  # the second request's 1024 shared tokens
    # At its peak the device holds the second request's 1,536 + 8 tokens in 16-token pages, the first's
    # 1,024 shared among them (the tree keeps whole pages only: not the first answer's last page).
    assert "| device | 1,552 |" in out, out


def test_a_bad_cost_model_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('kv_bytes_per_token = 2048\n[compute]\nflops = "fast"\n')
    assert main(["simulate", "--model", "tiny", "--cost-model", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "compute.flops must be a number" in err, err


def test_a_generated_workload_reuses_each_turns_prompt_and_answer(capsys):
    """`hicache bench`'s generator: a second turn finds the first turn's prompt and its simulated answer
    in the tree: its hit rate is the ideal one less what page granularity loses (under a 16-token page
    of its ~420 tokens), and above the first round's."""
    argv = ["simulate", "--model", "tiny", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2", "--gsp-num-turns",
            "2", "--gsp-system-prompt-len", "256", "--gsp-question-len", "64", "--gsp-output-len", "32"]  # fmt: skip
    assert main(argv) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[0] in ("0", "1"):
            rows[int(cells[0])] = [float(v.strip().rstrip("%")) for v in cells[1].split("/")[1:]]
    assert set(rows) == {0, 1}, rows
    (hit0, _), (hit1, ideal1) = rows[0], rows[1]
    assert 0 <= ideal1 - hit1 < 100 * 16 / 400 and hit1 > hit0, rows


@pytest.mark.parametrize("preset", ["epyc-2core-tiny", "h100x8-llama70b"])
def test_a_written_cost_model_reads_back_the_same(tmp_path, preset):
    """What `hicache simulate --calibrate` writes is a cost model `--cost-model` reads, figure for figure."""
    cost = load_cost_model(preset)
    path = tmp_path / f"{preset}.toml"
    path.write_text(to_toml(cost, "a note\non two lines"))
    assert load_cost_model(str(path)) == cost


TINY_WORKLOAD = ["--model", "tiny", "--gsp-num-groups", "1", "--gsp-prompts-per-group", "1", "--gsp-num-turns", "1",
                 "--gsp-system-prompt-len", "32", "--gsp-question-len", "16", "--gsp-output-len", "4"]  # fmt: skip


def _sim_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hicache.sim.cli" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("native_bf16", ["1", "0"])
def test_simulate_warns_in_one_line_when_the_flags_run_another_dtype_than_the_presets(monkeypatch, caplog,
                                                                                      native_bf16):  # fmt: skip
    """The CPU preset was measured in bf16 on an AVX512-BF16 EPYC: `--dtype auto` on tiny runs bf16 where
    the CPU has native bf16 (no warning) and float32 on an AVX2-only one (one line, saying what to pass)."""
    monkeypatch.setenv("HICACHE_CPU_BF16", native_bf16)
    preset = load_cost_model("epyc-2core-tiny")
    assert (preset.device, preset.dtype, preset.kv_bytes_per_token) == ("cpu", "bfloat16", 1024)
    assert "AVX512_BF16" in preset.measured_on
    with caplog.at_level(logging.WARNING):
        assert main(["simulate", *TINY_WORKLOAD]) == 0
    warnings = _sim_warnings(caplog)
    if native_bf16 == "1":
        assert warnings == []
    else:
        assert len(warnings) == 1 and "\n" not in warnings[0], warnings
        assert "is for bfloat16" in warnings[0] and "run float32 on this CPU" in warnings[0], warnings
        assert "--dtype bfloat16" in warnings[0] and preset.measured_on in warnings[0], warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["simulate", *TINY_WORKLOAD, "--dtype", "bfloat16"]) == 0  # as the preset: on either kind
    assert _sim_warnings(caplog) == []


def test_a_gpu_preset_resolves_auto_as_its_gpu_would(caplog):
    """`--dtype auto` for a CUDA preset is CUDA's bf16, whatever this machine has; float32 asked for warns."""
    gpu = load_cost_model("h100x8-llama70b")
    assert (gpu.device, gpu.dtype) == ("cuda", "bfloat16") and "H100" in gpu.measured_on
    with caplog.at_level(logging.WARNING):
        warn_of_another_dtype(EngineConfig(model="tiny"), gpu)
        assert _sim_warnings(caplog) == []
        warn_of_another_dtype(EngineConfig(model="tiny", dtype="float32"), gpu)
    (warning,) = _sim_warnings(caplog)
    assert "run float32 on cuda" in warning, warning


@pytest.mark.parametrize(
    ("line", "bad", "message"),
    [
        ('dtype = "bfloat16"', 'dtype = "fp8"', "dtype must be one of float32, bfloat16, float16"),
        ('device = "cpu"', 'device = "tpu"', "device must be one of cpu, cuda"),
    ],
)
def test_a_cost_models_dtype_and_device_are_checked(tmp_path, line, bad, message):
    path = tmp_path / "bad.toml"
    path.write_text(to_toml(load_cost_model("epyc-2core-tiny"), "a note").replace(line, bad))
    with pytest.raises(UserError, match=message):
        load_cost_model(str(path))
