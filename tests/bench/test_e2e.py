"""`hicache bench` against real `hicache serve` processes on `tiny`: a cache-off arm reports a hit rate of
0, a cache-on arm more than 0 and no more than the ideal (request by request), the report renders, and
a warm-then-restart arm measures a second pass on a restarted server."""

from __future__ import annotations

import json
import pathlib

import pytest

from hicache.bench.config import Arm, BenchConfig
from hicache.bench.launcher import ServerProcess
from hicache.bench.report import PLOTS, write_report
from hicache.bench.runner import run_bench
from hicache.bench.workload import GSPParams
from hicache.cli import build_parser, main
from hicache.errors import UserError


def _has_serve() -> bool:
    try:
        build_parser().parse_args(["serve", "--model", "tiny"])
    except (UserError, SystemExit):
        return False
    return True


pytestmark = [
    pytest.mark.skipif(not _has_serve(), reason="`hicache serve` is not available"),
    pytest.mark.slow,  # servers: `make test-fast` leaves these out
]

WORKLOAD = [
    "--gsp-num-groups",
    "2",
    "--gsp-prompts-per-group",
    "2",
    "--gsp-system-prompt-len",
    "96",
    "--gsp-question-len",
    "16",
    "--gsp-output-len",
    "8",
    "--gsp-num-turns",
    "3",
]


def test_cache_off_is_zero_and_cache_on_is_within_the_ideal(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "e2e.jsonl"
    code = main(
        [
            "bench",
            *WORKLOAD,
            "--launch",
            "--model tiny --disable-radix-cache",
            "--launch",
            "--model tiny",
            "--arm-names",
            "off,on",
            "--flush-cache",
            "--max-concurrency",
            "4",
            "--output-file",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summaries = {r["arm"]: r for r in rows if r["type"] == "summary"}
    requests = [r for r in rows if r["type"] == "request"]
    off, on = summaries["off"], summaries["on"]
    for s in (off, on):
        assert s["completed"] == 12 and s["failed"] == 0 and s["flushed"] is True and s["tiers_reported"]
        assert s["ideal_hit_rate"] > 0.5  # three turns over a shared system prompt
    assert off["hit_rate"] == 0 and off["hit_rate_by_tier"] == {"device": 0, "host": 0, "storage": 0}
    assert 0 < on["hit_rate"] <= on["ideal_hit_rate"]
    assert on["hit_rate_by_tier"]["device"] == pytest.approx(on["hit_rate"])
    for row in requests:
        assert row["prompt_tokens"] == row["prompt_tokens_client"]  # the server tokenizes what we counted
        assert row["output_tokens"] == 8  # ignore_eos: exact output lengths
        if row["arm"] == "off":
            assert row["cached_tokens"] == 0
    # Within the ceiling round by round too (not request by request: two requests sharing a prefix that
    # are in flight together may be served in another order than they were sent).
    for per_round in on["per_round"]:
        assert per_round["hit_rate"] <= per_round["ideal_hit_rate"]
    on_rows = [r for r in requests if r["arm"] == "on"]
    assert on["hit_rate"] == pytest.approx(
        sum(r["cached_tokens"] for r in on_rows) / sum(r["prompt_tokens"] for r in on_rows)
    )
    write_report([out], tmp_path / "report")
    assert all((tmp_path / "report" / name).stat().st_size > 0 for name in PLOTS)


def test_warm_then_restart_measures_a_second_pass(tmp_path: pathlib.Path) -> None:
    params = GSPParams(
        num_groups=1, prompts_per_group=2, system_prompt_len=64, question_len=8, output_len=4, num_turns=2
    )
    out = tmp_path / "warm.jsonl"
    config = BenchConfig(
        workload=params,
        arms=(Arm("warm", ("--model", "tiny"), warm_then_restart=True),),
        endpoint="chat",
        warmup_requests=0,
        output_file=str(out),
        progress=False,
    )
    (summary,) = run_bench(config)
    assert summary["completed"] == 4 and summary["warm_then_restart"] is True
    rows = [json.loads(line) for line in out.read_text().splitlines()][:-1]
    # The server renders the chat template as the benchmark does: the ideal is computed on its tokens.
    assert all(r["prompt_tokens"] == r["prompt_tokens_client"] for r in rows)
    # The first pass sent the same conversations (greedy answers repeat), so an infinite cache that
    # survived the restart would serve nearly everything; a device-only server kept nothing.
    assert summary["ideal_hit_rate"] > 0.9
    assert summary["hit_rate"] < summary["ideal_hit_rate"]


def test_a_server_that_cannot_start_is_a_user_error() -> None:
    server = ServerProcess(["--model", "no-such-model"])
    with pytest.raises(UserError, match="exited with code 2 before it was healthy"):
        server.start()
    assert server.pid is None  # stopped and forgotten
