"""`hicache bench --launch-pd`: a prefill-decode deployment per arm, in order among the other arms, its
flags checked at once; and the P/D columns of the summary (transferred tokens from usage)."""

from __future__ import annotations

import pytest

from hicache.bench.cli import config_from_args
from hicache.bench.config import Arm
from hicache.bench.metrics import RequestRecord, summarize
from hicache.bench.report import markdown_table
from hicache.cli import build_parser
from hicache.errors import UserError


def test_pd_arms_keep_their_place_among_the_others() -> None:
    args = build_parser().parse_args(
        ["bench", "--launch", "--model tiny", "--launch-pd", "--model tiny", "--model tiny --enable-hierarchical-cache"]
    )
    first, second = config_from_args(args).arms
    assert first.serve_args == ("--model", "tiny") and first.pd_args is None
    assert second.serve_args is None
    assert second.pd_args == (("--model", "tiny"), ("--model", "tiny", "--enable-hierarchical-cache"))
    assert second.name == "P/D: prefill [--model tiny] decode [--model tiny --enable-hierarchical-cache]"


@pytest.mark.parametrize(
    ("pd", "named"),
    [
        ((("--port", "1"), ()), "--port is chosen by the benchmark"),
        (((), ("--disaggregation-mode", "decode")), "chooses --disaggregation-mode itself"),
    ],
)
def test_pd_flags_the_benchmark_chooses_are_refused(pd, named) -> None:
    with pytest.raises(UserError, match=named):
        Arm("x", pd_args=pd)


def test_the_summary_counts_transferred_tokens_when_the_server_reports_them() -> None:
    records = [RequestRecord("a", 0, 0, 1, 0.0, prompt_tokens=100, ttft_s=0.1, transferred_tokens=t) for t in (100, 20)]
    summary = summarize("a", records, 1.0, {"kv_bytes_transferred": 3 * 2**20})
    assert summary["transferred_tokens"] == 120
    plain = summarize("b", [RequestRecord("b", 0, 0, 1, 0.0, prompt_tokens=100, ttft_s=0.1)], 1.0, {})
    assert plain["transferred_tokens"] is None
    table = markdown_table([summary, plain])
    assert "| P/D: prompt tokens transferred | 120 | n/a |" in table and "3.0 MiB" in table
