"""`hicache bench report`: the Markdown table (arms side by side, ratios against the first arm) and the
three plots, from output files of a fake-server run and hand-written summaries."""

from __future__ import annotations

import json
import pathlib

import pytest

from hicache.bench.report import PLOTS, load_results, markdown_table, write_report
from hicache.bench.config import Arm, BenchConfig
from hicache.bench.runner import run_bench
from hicache.bench.workload import GSPParams, load_tokenizer
from hicache.errors import UserError
from tests.bench.fake_server import FakeOpenAIServer


def summary(arm: str, ttft: float, hit: float | None, tiers: dict | None) -> dict:
    return {
        "type": "summary",
        "arm": arm,
        "completed": 4,
        "failed": 0,
        "duration_s": 1.0,
        "ttft_mean_s": ttft,
        "ttft_median_s": ttft,
        "ttft_p99_s": ttft * 2,
        "hit_rate": hit,
        "ideal_hit_rate": 0.8,
        "hit_rate_by_tier": tiers or {"device": None, "host": None, "storage": None},
        "input_throughput": 100.0,
        "per_round": [
            {
                "round": 1,
                "hit_rate": hit,
                "ideal_hit_rate": 0.5,
                "hit_rate_by_tier": tiers,
                "ttft_mean_s": ttft,
                "ttft_p99_s": ttft,
            },
            {
                "round": 2,
                "hit_rate": hit,
                "ideal_hit_rate": 0.9,
                "hit_rate_by_tier": tiers,
                "ttft_mean_s": ttft / 2,
                "ttft_p99_s": ttft,
            },
        ],
    }


def test_table_has_arms_side_by_side_with_ratios() -> None:
    table = markdown_table(
        [summary("off", 0.2, 0.0, None), summary("on", 0.05, 0.4, {"device": 0.3, "host": 0.1, "storage": 0.0})]
    )
    lines = table.splitlines()
    assert lines[0] == "| metric | off | on | on / off |"
    assert "| TTFT mean | 200.0 ms | 50.0 ms | 0.25x |" in lines
    assert "| hit rate | 0.0% | 40.0% | — |" in lines  # no ratio against zero
    assert "| hit rate / ideal | 0.0% | 50.0% | — |" in lines
    assert "| device hit rate | n/a | 30.0% | — |" in lines  # tiers unknown for the first arm
    assert "| input throughput | 100.0 tok/s | 100.0 tok/s | 1.00x |" in lines


def test_report_from_a_run(tmp_path: pathlib.Path) -> None:
    fake = FakeOpenAIServer(load_tokenizer("tiny"))
    out = tmp_path / "run.jsonl"
    params = GSPParams(
        num_groups=2, prompts_per_group=2, system_prompt_len=40, question_len=8, output_len=4, num_turns=3
    )
    run_bench(
        BenchConfig(
            workload=params,
            arms=(Arm("fake"),),
            base_url="http://fake",
            tokenizer="tiny",
            output_file=str(out),
            progress=False,
        ),
        transport=fake.transport,
    )
    # A second file: an arm without tiers and without request rows (left out of the CDF, not an error).
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(summary("fake", 0.3, 0.2, None)) + "\n")
    table = write_report([out, other], tmp_path / "report")
    # The same arm name in two files is told apart by the file name.
    assert "| metric | run:fake | other:fake | other:fake / run:fake |" in table
    document = (tmp_path / "report" / "report.md").read_text()
    assert table in document and "## Per round" in document
    for name in PLOTS:
        path = tmp_path / "report" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
        assert f"![{name}]({name})" in document
    results = load_results([out])
    assert len(results) == 1 and len(results[0].requests) == 12


def test_report_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UserError, match="cannot read"):
        load_results([tmp_path / "missing.jsonl"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="no summary rows"):
        load_results([empty])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(UserError, match="bad.jsonl:1"):
        load_results([bad])
