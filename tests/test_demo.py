"""`hicache demo` as a user runs it (a subprocess on `tiny` with the quick workload: four arms, table,
report, plots, storage hits after the restart), plus the sizing and flag handling it is built on."""

from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys

import pytest

from hicache.bench.cli import config_from_args
from hicache.bench.report import PLOTS
from hicache.cli import build_parser, main
from hicache.demo import (
    ARM_NAMES,
    FULL,
    QUICK,
    bench_command,
    build_arms,
    device_pool_tokens,
    forwarded_engine_flags,
    host_ratio,
    largest_request_tokens,
    working_set_tokens,
)


@pytest.mark.slow
def test_demo_runs_four_arms_end_to_end(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "hicache", "demo", "--model", "tiny", "--quick", "--out", str(out), "--disable-tqdm"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| metric |"))
    assert all(f"| {name} |" in header for name in ARM_NAMES), header
    assert str(out / "report.md") in proc.stdout
    for name in ("report.md", *PLOTS):
        assert (out / name).stat().st_size > 0, name

    rows = [json.loads(line) for line in (out / "demo.jsonl").read_text().splitlines()]
    summaries = {row["arm"]: row for row in rows if row["type"] == "summary"}
    assert list(summaries) == list(ARM_NAMES)
    requests = QUICK.num_groups * QUICK.prompts_per_group * QUICK.num_turns
    for summary in summaries.values():
        assert summary["completed"] == requests and summary["failed"] == 0
    no_cache, device, device_host, restarted = (summaries[name] for name in ARM_NAMES)
    assert no_cache["hit_rate"] == 0
    # The host tier keeps what the small device pool had to evict.
    assert device_host["hit_rate"] > device["hit_rate"]
    assert device_host["hit_rate_by_tier"]["host"] > 0
    # After the restart nothing was in memory: the first turns' histories came back from storage.
    assert restarted["warm_then_restart"] is True
    assert restarted["hit_rate_by_tier"]["storage"] > 0


@pytest.mark.parametrize("workload", [FULL, QUICK], ids=["full", "quick"])
def test_pools_make_the_device_too_small_and_the_host_large_enough(workload) -> None:
    device = device_pool_tokens(workload, page_size=16)
    assert device % 16 == 0
    assert largest_request_tokens(workload) <= device < working_set_tokens(workload)
    assert host_ratio(workload, device) * device >= working_set_tokens(workload)


def demo_args(*argv: str):
    return build_parser().parse_args(["demo", *argv])


def test_engine_flags_given_are_forwarded_and_arm_flags_refused() -> None:
    assert forwarded_engine_flags(demo_args()) == ([], [])
    assert forwarded_engine_flags(demo_args("--dtype", "float32", "--hicache-write-policy", "write_back")) == (
        ["--dtype", "float32", "--hicache-write-policy", "write_back"],
        [],
    )
    # The demo's own flags are not forwarded as such.
    assert forwarded_engine_flags(demo_args("--max-total-tokens", "4096", "--hicache-storage-dir", "/x")) == ([], [])
    # The storage backend's go to the arm with a store only: the others would refuse them.
    extra = ["--hicache-storage-backend-extra-config", '{"fsync": true}']
    flags, storage = forwarded_engine_flags(demo_args(*extra))
    assert (flags, storage) == ([], extra)
    arms = build_arms("tiny", flags, 720, 2.75, "/tmp/store", "wait_complete", storage)
    assert [extra[0] in (arm.serve_args or ()) for arm in arms] == [False, False, False, True]


@pytest.mark.parametrize("flag", ["--disable-radix-cache", "--enable-hierarchical-cache"])
def test_an_arm_defining_flag_is_one_line_and_exit_2(flag, tmp_path, capsys) -> None:
    assert main(["demo", flag, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the demo sets it per arm" in err[0]
    assert not (tmp_path / "never").exists()


def test_printed_bench_command_measures_the_same_arms() -> None:
    arms = build_arms("tiny", ["--dtype", "float32"], 720, 2.75, "/tmp/store", "wait_complete")
    command = bench_command(QUICK, arms, "bench.jsonl")
    argv = shlex.split(command)
    assert argv[:2] == ["hicache", "bench"]
    config = config_from_args(build_parser().parse_args(argv[1:]))
    assert config.arms == arms
    assert config.workload == QUICK
    assert config.flush_cache and config.output_file == "bench.jsonl"
