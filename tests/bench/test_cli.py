"""`hicache bench` argument handling: nested `report`, arms from --launch / --launch-warm in order, and
one-line user errors (exit 2)."""

from __future__ import annotations

import pytest

from hicache.bench.cli import cmd_bench, cmd_report, config_from_args
from hicache.cli import build_parser, main


def parse(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def test_report_is_a_nested_subcommand() -> None:
    args = parse("report", "a.jsonl", "b.jsonl", "--out", "dir")
    assert args.func is cmd_report and args.files == ["a.jsonl", "b.jsonl"] and args.out == "dir"
    assert parse("--base-url", "http://x").func is cmd_bench


def test_arms_keep_their_order_and_options() -> None:
    args = parse(
        "--launch",
        "--model tiny --disable-radix-cache",
        "--launch-warm",
        "--model tiny",
        "--launch=--disable-radix-cache",
        "--launch",
        "",
        "--gsp-num-turns",
        "3",
        "--request-rate",
        "2",
    )
    cfg = config_from_args(args)
    assert [(a.serve_args, a.warm_then_restart) for a in cfg.arms] == [
        (("--model", "tiny", "--disable-radix-cache"), False),
        (("--model", "tiny"), True),
        (("--disable-radix-cache",), False),
        ((), False),
    ]
    assert [a.name for a in cfg.arms] == [
        "--model tiny --disable-radix-cache",
        "--model tiny +warm-restart",
        "--disable-radix-cache",
        "(default flags)",
    ]
    assert cfg.workload.num_turns == 3 and cfg.request_rate == 2.0 and cfg.extra_body == {"ignore_eos": True}


def test_arm_names_and_duplicates() -> None:
    cfg = config_from_args(parse("--launch", "--model tiny", "--launch", "--model tiny"))
    assert [a.name for a in cfg.arms] == ["--model tiny #1", "--model tiny #2"]
    cfg = config_from_args(parse("--launch", "--model tiny", "--launch", "--model tiny", "--arm-names", "a, b"))
    assert [a.name for a in cfg.arms] == ["a", "b"]
    cfg = config_from_args(parse("--base-url", "http://h:1", "--dataset", "multi-round", "--num-users", "2"))
    assert cfg.arms[0].name == "http://h:1" and cfg.workload.num_users == 2
    assert config_from_args(parse("--base-url", "http://h:1/v1/")).base_url == "http://h:1"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--base-url", "http://x", "--launch", "--model tiny"], "not both"),
        ([], "give a target"),
        (["--launch", "--model tiny", "--arm-names", "a,b"], "2 names for 1 arms"),
        (["--base-url", "http://x", "--extra-body", "[1]"], "JSON object"),
        (["--base-url", "http://x", "--gsp-num-groups", "0"], "num-groups must be positive"),
        (["--base-url", "http://x", "--max-concurrency", "0"], "--max-concurrency"),
        (["--launch", "--model tiny --port 5"], "--port is chosen by the benchmark"),
        (["report", "--out", "d"], "required"),
    ],
)
def test_user_errors_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
