"""Issue 24's multi-turn workload against any OpenAI-compatible server, for engine_bench: 4 conversations in
2 groups, each group's conversations sharing a 600-token system prompt, 4 turns of a 48-token question
and 24 output tokens (EOS ignored), sent interleaved: turn 1 of every conversation, then turn 2 of
every conversation, ..., one request at a time, so each TTFT is one request's own and a server whose
cache holds only its last prompt loses the shared prefix between groups. A turn's prompt is the whole
conversation so far with the server's own earlier answers, rendered with smollm2's chat template and
sent to /v1/completions with streaming; TTFT is the time to the first streamed text (hicache's bench
client, hicache/bench/client.py).

The text is the project's generated-shared-prefix dataset (hicache/bench/workload.py: seeded words of
exact token counts), built once per run and sent unchanged to every engine; only the answers, and so
the later turns' prompts, are each server's own. One warm-up request of the same shape from another
seed goes first, so first-call costs miss the measurement and the workload's prefixes stay cold.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, replace

import httpx

from hicache.bench.client import build_payload, served_model, stream_request
from hicache.bench.workload import GSPParams, Workload, conversation_messages, generated_shared_prefix
from hicache.model.tokenizer import Tokenizer

ISSUE_24 = GSPParams(
    num_groups=2, prompts_per_group=2, system_prompt_len=600, question_len=48, output_len=24, num_turns=4, seed=24
)


@dataclass(frozen=True)
class MultiTurn:
    """The measured workload (from `params`) and its warm-up, one conversation of the same shape from
    another seed."""

    params: GSPParams
    workload: Workload
    warmup: Workload


def multiturn_workload(tokenizer: Tokenizer, params: GSPParams = ISSUE_24) -> MultiTurn:
    warmup = replace(params, num_groups=1, prompts_per_group=1, num_turns=1, seed=params.seed + 1)
    return MultiTurn(params, generated_shared_prefix(params, tokenizer), generated_shared_prefix(warmup, tokenizer))


@dataclass(frozen=True)
class TurnRecord:
    conv_id: int
    group: int
    turn: int  # 1-based
    ttft_s: float | None
    prompt_tokens: int | None  # as the server counted them, where it reports usage
    cached_tokens: int | None  # the prompt tokens its cache served, where it reports them
    error: str | None


@dataclass(frozen=True)
class MultiTurnResult:
    records: tuple[TurnRecord, ...]

    @property
    def failed(self) -> list[TurnRecord]:
        return [r for r in self.records if r.error is not None]

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft_s for r in self.records if r.ttft_s is not None]

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(self.ttfts)

    @property
    def p90_ttft_s(self) -> float:
        return statistics.quantiles(self.ttfts, n=10, method="inclusive")[-1]

    def turn_median_ttft_s(self, turn: int) -> float:
        return statistics.median(r.ttft_s for r in self.records if r.turn == turn and r.ttft_s is not None)

    @property
    def cached_share(self) -> float | None:
        """Cached over prompt tokens, summed over the turns; None where the server reports no cached count."""
        counted = [r for r in self.records if r.cached_tokens is not None and r.prompt_tokens]
        if not counted:
            return None
        return sum(r.cached_tokens for r in counted) / sum(r.prompt_tokens for r in counted)


def run_multiturn(base_url: str, multiturn: MultiTurn, tokenizer: Tokenizer, extra_body: dict) -> MultiTurnResult:
    """Runs the workload once against the server at `base_url` (its root); `extra_body` goes into every
    request (what makes that server ignore EOS). Never raises for a server's failure, so one engine's
    does not end a long benchmark: a failed turn is recorded, and its conversation's later turns, which
    need its answer, are recorded as not sent (every turn, where the warm-up failed)."""
    return MultiTurnResult(tuple(asyncio.run(_run(base_url, multiturn, tokenizer, extra_body))))


async def _run(base_url: str, multiturn: MultiTurn, tokenizer: Tokenizer, extra_body: dict) -> list[TurnRecord]:
    records: list[TurnRecord] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        model = await served_model(client)

        async def send(conv, turn: int, answers: list[str]):
            messages = conversation_messages(conv, turn, answers)
            path, body = build_payload(
                "completions",
                model,
                messages,
                tokenizer.chat_template.render(messages),
                conv.turns[turn].output_len,
                extra_body,
            )
            return await stream_request(client, path, body)

        warm = await send(multiturn.warmup.conversations[0], 0, [])
        answers: dict[int, list[str]] = {conv.conv_id: [] for conv in multiturn.workload.conversations}
        for turn in range(multiturn.workload.num_rounds):
            for conv in multiturn.workload.conversations:
                said = answers[conv.conv_id]
                if warm.error is not None or len(said) < turn:
                    why = f"not sent: the warm-up failed: {warm.error}" if warm.error is not None else "not sent"
                    records.append(TurnRecord(conv.conv_id, conv.group, turn + 1, None, None, None, why))
                    continue
                result = await send(conv, turn, said)
                records.append(
                    TurnRecord(
                        conv.conv_id,
                        conv.group,
                        turn + 1,
                        result.ttft_s,
                        result.prompt_tokens,
                        result.cached_tokens,
                        result.error,
                    )
                )
                if result.error is None:
                    said.append(result.text)
    return records
