"""benchmarks/multiturn.py, engine_bench's multi-turn client, against a real `hicache serve` on `tiny`: every
turn gets a first token, every TTFT is positive, and from a group's second request on the server reports
the group's shared system prompt as cached; a conversation's later turns, its whole earlier prompt.
(The vLLM and llama.cpp peers it also runs against are not in CI; the client is the same for all.)"""

from __future__ import annotations

import pytest

from benchmarks.multiturn import MultiTurnResult, multiturn_workload, run_multiturn
from hicache.bench.launcher import ServerProcess
from hicache.bench.workload import GSPParams, load_tokenizer

PAGE = 16  # the engine's default page size: a cache serves whole pages
PARAMS = GSPParams(
    num_groups=2, prompts_per_group=2, system_prompt_len=96, question_len=16, output_len=8, num_turns=3, seed=24
)


@pytest.fixture(scope="module")
def result() -> MultiTurnResult:
    tokenizer = load_tokenizer("tiny")
    with ServerProcess(["--model", "tiny"]) as server:
        return run_multiturn(server.url, multiturn_workload(tokenizer, PARAMS), tokenizer, {"ignore_eos": True})


@pytest.mark.slow
def test_every_turn_gets_a_first_token(result: MultiTurnResult) -> None:
    assert len(result.records) == 12 and result.failed == []
    assert all(r.ttft_s is not None and r.ttft_s > 0 for r in result.records)
    assert 0 < result.median_ttft_s <= result.p90_ttft_s
    # Sent interleaved: every conversation's turn 1, then every conversation's turn 2, ...
    assert [r.turn for r in result.records] == [1] * 4 + [2] * 4 + [3] * 4
    assert [r.conv_id for r in result.records[:4]] == [r.conv_id for r in result.records[4:8]]


@pytest.mark.slow
def test_the_cache_serves_the_shared_system_prompt_and_earlier_turns(result: MultiTurnResult) -> None:
    groups_seen: set[int] = set()
    earlier_prompt: dict[int, int] = {}
    for r in result.records:
        assert r.prompt_tokens is not None and r.cached_tokens is not None
        if r.group in groups_seen:
            assert r.cached_tokens >= PARAMS.system_prompt_len // PAGE * PAGE, r
        if r.conv_id in earlier_prompt:  # this turn's prompt extends the last one with its answer
            assert r.cached_tokens >= earlier_prompt[r.conv_id] // PAGE * PAGE, r
        groups_seen.add(r.group)
        earlier_prompt[r.conv_id] = r.prompt_tokens
    assert result.cached_share is not None and result.cached_share > 0.5
