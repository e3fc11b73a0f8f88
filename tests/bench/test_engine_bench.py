"""benchmarks/engine_bench.py: its quick mode on `tiny` prints every row issue 16 asks for, with both
limits; the weight-byte and FLOP arithmetic of each format; and the llama.cpp peer's lifecycle and
parsing against a stand-in server (no llama.cpp needed). No figure is asserted: these are not timings."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest

from benchmarks import engine_bench as eb
from benchmarks.multiturn import ISSUE_24, MultiTurnResult, TurnRecord
from benchmarks.peers import Completion, LlamaCppServer
from hicache.bench.workload import load_tokenizer
from hicache.model.config import ModelConfig

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5, max_position=8192,
                      tie_word_embeddings=True)  # fmt: skip
LAYER_PARAMS = 30 * (576 * 576 * 2 + 192 * 576 * 2 + 1536 * 576 * 3)
ROWS = [
    "prefill 512 tokens",
    "prefill 2048 tokens",
    "decode batch 1",
    "decode batch 8 (aggregate)",
    "decode batch 32 (aggregate)",
    "TTFT, 64-token turn after a cached 2K prefix",
    "TTFT, same turn, radix cache off (2112 tokens)",
]


def table_rows(text: str, header_start: str) -> dict[str, list[str]]:
    """Rows of the markdown table whose header begins with `header_start`, by first cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_quick_mode_on_tiny_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    eb.main(["--quick", "--models", "tiny", "--quantizations", "none", "--dtypes", "bfloat16"])
    out = capsys.readouterr().out
    assert re.search(r"CPU: .+; torch \S+, \d+ threads", out)
    assert re.search(r"copy of \d+ MiB [\d.]+ GB/s counted as read \+ write", out)
    assert re.search(r"F.linear \d+\^2 bf16 [\d.]+ GFLOP/s, \d+\^2 fp32 [\d.]+ GFLOP/s", out)
    assert "### tiny, bf16 dense" in out
    rows = table_rows(out, "| measurement | hicache | bandwidth limit | matmul limit | of limit |")
    assert list(rows) == ROWS
    for name, cells in rows.items():
        unit = "ms" if name.startswith("TTFT") else "tok/s"
        assert all(re.match(rf"[\d.]+ {unit}", c) for c in cells[:3]), (name, cells)
        assert float(cells[3]) > 0
    # The turn found the whole 2K history in the cache (page-aligned), so it computed only its 64 tokens.
    assert "(2048 cached)" in rows["TTFT, 64-token turn after a cached 2K prefix"][0]
    assert "llama.cpp peer skipped" in out and "pip install 'llama-cpp-python[server]'" in out
    assert "### Issue 16's aims" not in out  # the aims are smollm2's


def test_weight_bytes_per_format() -> None:
    def dense(name: str) -> str:
        return "dense"

    bf16 = eb.weight_bytes(SMOLLM2, dense, 2)
    assert bf16.layers == 2 * LAYER_PARAMS and bf16.lm_head == 2 * 49152 * 576 and bf16.embedding_row == 2 * 576
    assert eb.weight_bytes(SMOLLM2, dense, 4).layers == 4 * LAYER_PARAMS
    int8 = eb.weight_bytes(SMOLLM2, eb.Format("int8", "bfloat16").kind_of("smollm2"), 2)
    rows = 30 * (576 * 2 + 192 * 2 + 1536 * 2 + 576)  # output rows, one bf16 scale each
    assert int8.layers == LAYER_PARAMS + 2 * rows and int8.lm_head == 49152 * 576 + 2 * 49152
    int4 = eb.weight_bytes(SMOLLM2, eb.Format("int4", "bfloat16").kind_of("smollm2"), 2)
    assert int4.layers == LAYER_PARAMS * (0.5 + 4 / 32) and int4.lm_head == 49152 * 576 * 0.625
    assert int8.norms == int4.norms == bf16.norms == 61 * 576 * 2
    stored = {"norm": "f32", "token_embd": "q8_0"}  # smollm2's GGUF: Q4_1 layers, Q8_0 tied embedding
    gguf = eb.weight_bytes(SMOLLM2, lambda name: stored.get(name, "q4_1"), 2)
    assert gguf.layers == LAYER_PARAMS * 20 / 32 and gguf.lm_head == 49152 * 576 * 34 / 32
    assert gguf.norms == 61 * 576 * 4 and gguf.embedding_row == 576 * 34 / 32


def test_limits_count_weights_kv_and_causal_attention() -> None:
    machine = eb.Machine(copy_gbps=10.0, gflops={"bfloat16": 100.0, "float32": 50.0})
    w = eb.weight_bytes(SMOLLM2, lambda name: "dense", 2)
    one = eb.forward_limits(SMOLLM2, w, 2, machine, "bfloat16", batch=1, new=1, start=99, logits_rows=1)
    kv = 30 * 2 * 192 * 2 * 100
    assert one.bandwidth_s == pytest.approx((w.per_forward + w.embedding_row + kv) / 10e9)
    flops = 2 * LAYER_PARAMS + 4 * 30 * 576 * 100 + 2 * 49152 * 576
    assert one.matmul_s == pytest.approx(flops / 100e9)
    eight = eb.forward_limits(SMOLLM2, w, 2, machine, "bfloat16", batch=8, new=1, start=99, logits_rows=1)
    assert eight.matmul_s == pytest.approx(8 * one.matmul_s)  # weights are read once for the batch
    assert eight.bandwidth_s == pytest.approx((w.per_forward + 8 * (w.embedding_row + kv)) / 10e9)
    prefill = eb.forward_limits(SMOLLM2, w, 2, machine, "float32", batch=1, new=4, start=0, logits_rows=1)
    assert prefill.matmul_s == pytest.approx((8 * LAYER_PARAMS + 4 * 30 * 576 * 10 + 2 * 49152 * 576) / 50e9)


def test_completion_reads_llama_cpp_timings() -> None:
    log = (
        "Llama.generate: 2047 prefix-match hit, remaining 65 prompt tokens to eval\n"
        "llama_perf_context_print:        load time =     100.00 ms\n"
        "llama_perf_context_print: prompt eval time =     150.50 ms /    65 tokens (    2.32 ms per token)\n"
        "llama_perf_context_print:        eval time =      62.00 ms /    31 runs   (    2.00 ms per token)\n"
    )
    body = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 2112, "completion_tokens": 32}}
    c = Completion.from_llama_cpp(0.3, body, log)
    assert c.prompt_eval == (pytest.approx(0.1505), 65) and c.eval == (pytest.approx(0.062), 31)
    assert c.prefix_hit == 2047 and c.prompt_tokens == 2112 and c.completion_tokens == 32
    bare = Completion.from_llama_cpp(0.3, body, "")
    assert bare.prompt_eval is None and bare.eval is None and bare.prefix_hit == 0


def test_llama_cpp_peer_against_a_stand_in_server(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "llama_cpp"
    (package / "server").mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "fake"\n')
    (package / "server" / "__main__.py").write_text("from tests.bench.fake_llama_cpp_server import main\n\nmain()\n")
    root = pathlib.Path(eb.__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(root)]))
    args_file = tmp_path / "args.json"
    monkeypatch.setenv("FAKE_LLAMA_ARGS_FILE", str(args_file))
    server = LlamaCppServer(sys.executable, tmp_path / "model.gguf", 3)
    peer = eb.measure_peer(server, eb.QUICK, load_tokenizer("tiny"), multiturn=None)
    args = json.loads(args_file.read_text())
    assert args["n_threads"] == args["n_threads_batch"] == "3" and args["n_ctx"] == "4096"
    assert args["host"] == "127.0.0.1" and args["model"] == str(tmp_path / "model.gguf")
    with pytest.raises(ProcessLookupError):  # stopped by its pid
        os.kill(args["pid"], 0)
    assert set(peer.seconds) == {"prefill 512", "prefill 2048", "decode batch 1", "ttft hit", "ttft off"}
    # Timed prompts start differently (tiny's byte tokens: the fake's prompt cache reuses no more than a
    # few bytes of them); the TTFT turn reuses the 2K history.
    assert 512 - 8 <= peer.tokens["prefill 512"] <= 512 and 2048 - 8 <= peer.tokens["prefill 2048"] <= 2048
    assert peer.tokens["ttft hit"] <= 64 + 1 and peer.tokens["ttft off"] >= 2048 + 64 - 8
    assert peer.tokens["decode batch 1"] == eb.QUICK.decode_steps
    assert peer.own["decode batch 1"] == (pytest.approx(0.002 * eb.QUICK.decode_steps), eb.QUICK.decode_steps)
    assert peer.own["prefill 2048"][1] == peer.tokens["prefill 2048"]
    assert "llama-cpp-python fake" in peer.notes[0] and len(peer.notes) == 1  # every printed timing was kept
    assert set(peer.own) == set(peer.seconds)


def test_printed_timings_that_disagree_with_the_wall_time_are_dropped() -> None:
    peer = eb.PeerResult("llama.cpp")
    peer.keep_own("prefill 512", (0.00026, 512), 17.8)  # what llama-cpp-python 0.3.36 printed on a first request
    peer.keep_own("prefill 2048", (4.9, 2048), 5.0)
    assert list(peer.own) == ["prefill 2048"] and "0.26 ms for prefill 512" in peer.notes[0]


@pytest.mark.slow
def test_auto_counts_the_checkpoints_own_types() -> None:
    from hicache.errors import UserError
    from hicache.model.loading.gguf_loader import smollm2_path

    try:
        smollm2_path()
    except UserError as exc:
        pytest.skip(str(exc))
    auto = eb.weight_bytes(SMOLLM2, eb.Format("auto", "bfloat16").kind_of("smollm2"), 2)
    # Q4_1 layers -> int4 group 32; the Q8_0 tied embedding -> int8 per channel; f32 norms -> bf16.
    assert auto.layers == LAYER_PARAMS * 0.625 and auto.lm_head == 49152 * 576 + 2 * 49152
    assert auto.norms == 61 * 576 * 2


def multiturn_result(turn_ttfts: list[float], cached: int | None) -> MultiTurnResult:
    """4 conversations x the given turns, every conversation's turn t taking turn_ttfts[t - 1]."""
    return MultiTurnResult(
        tuple(
            TurnRecord(conv, conv % 2, turn, ttft, 100, cached, None)
            for turn, ttft in enumerate(turn_ttfts, 1)
            for conv in range(4)
        )
    )


def test_the_multi_turn_table_and_issue_24s_aims_set_hicache_against_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    hicache = {"fp32 dense": multiturn_result([0.8, 0.2, 0.2, 0.2], 50)}
    llama = eb.PeerResult("llama.cpp", multiturn=multiturn_result([2.0, 1.0, 1.0, 1.0], None))
    vllm = eb.PeerResult(
        "vLLM",
        seconds={"ttft hit": 0.5, "decode batch 1": 1.0},
        tokens={"ttft hit": 64, "decode batch 1": 30},
        multiturn=multiturn_result([0.5, 0.25, 0.25, 0.25], 40),
    )
    eb.print_multiturn(hicache, [llama, vllm], ISSUE_24)
    measured = eb.Measured(seconds={"ttft hit": 0.3, "decode batch 1": 2.0}, tokens={"decode batch 1": 30})
    eb.print_vllm_aims({"fp32 dense": measured}, hicache, vllm)
    out = capsys.readouterr().out
    assert "4 conversations in 2 groups sharing 600-token system prompts, 4 turns" in out
    rows = table_rows(out, "| server | median TTFT | p90 TTFT |")
    # 12 of 16 turns at 200 ms: the median; the 4 first turns at 800 ms are beyond the 90th percentile's rank
    hicache_row = ["200 ms", "800 ms", "800 ms", "200 ms", "200 ms", "200 ms", "50.0%", "0.80"]
    assert rows["hicache serve, fp32 dense"] == hicache_row
    assert rows["llama.cpp"][-2:] == ["", "4.00"]  # it reports no cached tokens
    assert rows["vLLM"][0] == "250 ms" and rows["vLLM"][-1] == "1.00"
    aims = table_rows(out, "| aim | target | fp32 dense |")
    assert aims["multi-turn median TTFT / vLLM's"] == ["<= 0.8", "0.80 (met)"]
    assert aims["TTFT, 64-token turn after a cached 2K prefix / vLLM's"] == ["<= 0.8", "0.60 (met)"]
    assert aims["decode batch 1 / vLLM's (no target)"] == ["", "0.50 (15.0 / 30.0 tok/s)"]
