"""`run_bench` against a fake OpenAI-compatible server (no model, no network): multi-turn histories carry
the server's answers, the ideal hit rate equals the hits of a server whose cache is exactly the
infinite cache, the output file's summary agrees with its request rows, and failures are contained."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from hicache.bench.config import Arm, BenchConfig, serve_model
from hicache.bench.metrics import TIERS
from hicache.bench.runner import run_bench
from hicache.bench.workload import GSPParams, MultiRoundParams, load_tokenizer
from hicache.errors import UserError
from tests.bench.fake_server import FakeOpenAIServer

URL = "http://fake"
GSP_SMALL = GSPParams(
    num_groups=2, prompts_per_group=3, system_prompt_len=60, question_len=12, output_len=6, num_turns=3, seed=7
)


@pytest.fixture
def fake() -> FakeOpenAIServer:
    return FakeOpenAIServer(load_tokenizer("tiny"))


def config(**overrides) -> BenchConfig:
    base = {"workload": GSP_SMALL, "arms": (Arm("fake"),), "base_url": URL, "tokenizer": "tiny", "progress": False}
    return BenchConfig(**{**base, **overrides})


def read_rows(path: pathlib.Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r["type"] == "request"], [r for r in rows if r["type"] == "summary"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("flush_status", [200, 404])
def test_ideal_equals_the_hits_of_an_exact_infinite_cache(
    fake: FakeOpenAIServer, tmp_path: pathlib.Path, endpoint: str, flush_status: int
) -> None:
    fake.flush_status = flush_status
    out = tmp_path / "run.jsonl"
    (summary,) = run_bench(
        config(endpoint=endpoint, flush_cache=True, warmup_requests=2, max_concurrency=4, output_file=str(out)),
        transport=fake.transport,
    )
    requests, summaries = read_rows(out)
    assert summaries == [summary]
    assert summary["flushed"] is (flush_status == 200) and fake.flushes == (1 if flush_status == 200 else 0)
    assert len(requests) == 18 and summary["completed"] == 18 and summary["failed"] == 0
    assert sorted((r["conv_id"], r["round"]) for r in requests) == [(c, t) for c in range(6) for t in (1, 2, 3)]
    for row in requests:
        # The fake's cache holds exactly what the ideal cache holds, so they agree request by request.
        assert row["cached_tokens"] == row["ideal_cached_tokens"]
        assert row["prompt_tokens"] == row["prompt_tokens_client"]
        assert row["output_tokens"] == 6 and row["error"] is None
    assert summary["hit_rate"] == pytest.approx(summary["ideal_hit_rate"]) and summary["hit_rate"] > 0.5
    # Warm-up requests are not rows, and max_tokens is what the workload asked for.
    assert len(fake.bodies) == 18 + 2 and all(b["stream_options"] == {"include_usage": True} for b in fake.bodies)
    assert all(b["ignore_eos"] is True and b["temperature"] == 0.0 for b in fake.bodies)


def test_each_turn_carries_the_servers_earlier_answers(fake: FakeOpenAIServer) -> None:
    run_bench(config(warmup_requests=0), transport=fake.transport)
    prompts = fake.prompts
    later = [p for p in prompts if p.count("user:") > 1]
    assert len(later) == 12
    for prompt in later:
        # The history up to the last question is an earlier prompt followed by the fake's answer to it.
        earlier = max((p for p in prompts if prompt.startswith(p.rsplit("assistant:", 1)[0]) and p != prompt), key=len)
        assert f"assistant: {fake.answers[earlier]}\n" in prompt


def test_summary_agrees_with_request_rows(fake: FakeOpenAIServer, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run.jsonl"
    run_bench(config(output_file=str(out), max_concurrency=2), transport=fake.transport)
    rows, (summary,) = read_rows(out)
    prompt = sum(r["prompt_tokens"] for r in rows)
    assert summary["hit_rate"] == pytest.approx(sum(r["cached_tokens"] for r in rows) / prompt)
    assert summary["ideal_hit_rate"] == pytest.approx(sum(r["ideal_cached_tokens"] for r in rows) / prompt)
    for tier in TIERS:
        tier_sum = sum(r["cached_tokens_by_tier"][tier] for r in rows)
        assert summary["hit_rate_by_tier"][tier] == pytest.approx(tier_sum / prompt)
    ttfts = [r["ttft_s"] for r in rows]
    assert summary["ttft_mean_s"] == pytest.approx(np.mean(ttfts))
    assert summary["ttft_median_s"] == pytest.approx(np.median(ttfts))
    assert summary["ttft_p99_s"] == pytest.approx(np.percentile(ttfts, 99))
    assert summary["itl_mean_s"] == pytest.approx(np.mean([g for r in rows for g in r["itl_s"]]))
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in rows)
    assert summary["output_throughput"] == pytest.approx(summary["total_output_tokens"] / summary["duration_s"])
    for per_round in summary["per_round"]:
        mine = [r for r in rows if r["round"] == per_round["round"]]
        assert per_round["requests"] == len(mine) == 6
        assert per_round["ttft_mean_s"] == pytest.approx(np.mean([r["ttft_s"] for r in mine]))
        assert per_round["hit_rate"] == pytest.approx(
            sum(r["cached_tokens"] for r in mine) / sum(r["prompt_tokens"] for r in mine)
        )
    # Rounds get longer and reuse more: the ideal grows with the history.
    ideals = [r["ideal_hit_rate"] for r in summary["per_round"]]
    assert ideals == sorted(ideals)


def test_failed_request_ends_its_conversation_only(fake: FakeOpenAIServer, tmp_path: pathlib.Path) -> None:
    (summary,) = run_bench(config(warmup_requests=0), transport=fake.transport)
    # A question of round 2 of some conversation: fail every prompt that contains it.
    fake2 = FakeOpenAIServer(fake.tokenizer)
    victim = next(p for p in fake.prompts if p.count("user:") == 2).rsplit("user: ", 1)[1].split("\n")[0]
    fake2.fail_prompts_containing = victim
    out = tmp_path / "run.jsonl"
    (summary,) = run_bench(config(warmup_requests=0, output_file=str(out)), transport=fake2.transport)
    rows, _ = read_rows(out)
    failed = [r for r in rows if r["error"]]
    assert len(failed) == 1 and failed[0]["round"] == 2 and "HTTP 500" in failed[0]["error"]
    # Its round 3 was never sent; every other conversation completed.
    assert summary["failed"] == 1 and summary["completed"] == 16 and len(rows) == 17


def test_server_without_tiers() -> None:
    fake = FakeOpenAIServer(load_tokenizer("tiny"), report_tiers=False)
    (summary,) = run_bench(config(endpoint="chat"), transport=fake.transport)
    assert summary["model"] == "fake-model"  # from GET /v1/models
    assert summary["hit_rate_by_tier"] == {"device": None, "host": None, "storage": None}
    assert summary["hit_rate"] > 0 and not summary["tiers_reported"]
    assert all(b["model"] == "fake-model" and "messages" in b for b in fake.bodies)


def test_multi_round_dataset_runs(fake: FakeOpenAIServer) -> None:
    params = MultiRoundParams(num_users=3, num_rounds=2, shared_system_prompt_len=40, user_history_prompt_len=30,
                              question_len=5, answer_len=4, user_join_interval_s=0.05)  # fmt: skip
    (summary,) = run_bench(config(workload=params), transport=fake.transport)
    assert summary["completed"] == 6 and summary["dataset"] == "multi-round" and summary["num_rounds"] == 2
    assert summary["hit_rate"] == pytest.approx(summary["ideal_hit_rate"])


def test_config_validation() -> None:
    with pytest.raises(UserError, match="no serve flags"):
        BenchConfig(workload=GSP_SMALL, arms=(Arm("a"),))
    with pytest.raises(UserError, match="warm-then-restart"):
        BenchConfig(workload=GSP_SMALL, arms=(Arm("a", warm_then_restart=True),), base_url=URL)
    with pytest.raises(UserError, match="unique"):
        BenchConfig(workload=GSP_SMALL, arms=(Arm("a", ()), Arm("a", ())))
    with pytest.raises(UserError, match="request-rate"):
        config(request_rate=0)
    with pytest.raises(UserError, match="--tokenizer"):
        run_bench(config(tokenizer=None), transport=FakeOpenAIServer(load_tokenizer("tiny")).transport)
    assert serve_model(["--disable-radix-cache"]) == ("tiny", "tiny")
    assert serve_model(["--model-path", "smollm2", "--served-model-name", "s"]) == ("smollm2", "s")
