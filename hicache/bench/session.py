"""One arm's traffic (the `bench` part of the design): warm-up, flush and passes of the workload against
one server URL, and the log of what the server saw.

Traffic model (SGLang's multi-turn semantics): a conversation holds one of `max_concurrency` slots from
its first turn to its last; turn k+1 is sent as soon as turn k's answer has arrived, because it contains
that answer. Conversations start as a Poisson process of `request_rate` per second (all at once for
`inf`), never before their dataset's join time (multi-round's staggered users).

Every prompt sent and answer received is logged in order; after the measured pass the log is replayed
through `IdealCache` to compute each request's ideal hit, so no tokenization runs on the timed path.
The log of an arm spans its warm-up, its warming pass and the restart (an infinite cache survives
restarts), and is cut only where the server's cache was flushed: a warm-then-restart arm's ideal is
what a perfect storage tier could serve.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from hicache.bench.client import build_payload, flush_cache, stream_request
from hicache.bench.config import Arm, BenchConfig
from hicache.bench.metrics import IdealCache, RequestRecord
from hicache.bench.workload import Conversation, Workload, conversation_messages
from hicache.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Warm-up requests only have to reach every code path once; long outputs would just cost time.
WARMUP_MAX_TOKENS = 16


@dataclass
class _Sent:
    """A request as the ideal-cache replay needs it; `record` is None outside the measured pass."""

    messages: list[dict[str, str]]
    prompt_text: str | None
    record: RequestRecord | None
    answer: str = ""
    prompt_ids: list[int] = field(default_factory=list)


class _EventLog:
    """What the server saw, in order: a request sent, its answer received, a flush of its cache."""

    def __init__(self) -> None:
        self._events: list[tuple[str, _Sent | None]] = []

    def sent(self, sent: _Sent) -> None:
        self._events.append(("send", sent))

    def answered(self, sent: _Sent) -> None:
        self._events.append(("answer", sent))

    def flushed(self) -> None:
        self._events.append(("flush", None))

    def replay(self, tokenizer: Tokenizer) -> None:
        """Fills each measured record's ideal hit and client-side token counts."""
        cache = IdealCache()
        for kind, sent in self._events:
            if sent is None:
                cache.clear()
            elif kind == "send":
                text = sent.prompt_text
                if text is None:
                    text = tokenizer.chat_template.render(sent.messages)
                sent.prompt_ids = tokenizer.encode(text)
                reusable = cache.on_send(sent.prompt_ids)
                record = sent.record
                if record is not None:
                    record.ideal_cached_tokens = reusable
                    record.prompt_tokens_client = len(sent.prompt_ids)
                    if record.prompt_tokens == 0:
                        record.prompt_tokens = record.prompt_tokens_client  # the server reported no usage
            else:
                output_ids = tokenizer.encode(sent.answer)
                cache.on_finish(sent.prompt_ids, output_ids)
                record = sent.record
                if record is not None and record.output_tokens == 0:
                    record.output_tokens = len(output_ids)  # the server reported no usage


class ArmSession:
    """One arm against one server URL: warm-up, flush and passes, all feeding one event log."""

    def __init__(
        self,
        config: BenchConfig,
        arm: Arm,
        workload: Workload,
        tokenizer: Tokenizer,
        model: str,
        transport: httpx.AsyncBaseTransport | None,
    ) -> None:
        self.config = config
        self.arm = arm
        self.workload = workload
        self.tokenizer = tokenizer
        self.model = model
        self.transport = transport
        self.log = _EventLog()

    def _client(self, url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(self.config.request_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            transport=self.transport,
        )

    async def warm_up_and_flush(self, url: str) -> bool:
        """Sends the warm-up requests, then flushes if asked. Returns whether the cache was flushed."""
        async with self._client(url) as client:
            if self.config.warmup_requests:
                conv = self.workload.conversations[0]
                limit = asyncio.Semaphore(self._concurrency())

                async def one() -> None:
                    async with limit:
                        await self._request(client, conv, 0, [], None, WARMUP_MAX_TOKENS)

                await asyncio.gather(*(one() for _ in range(self.config.warmup_requests)))
            if not self.config.flush_cache:
                return False
            flushed = await flush_cache(client)
            if flushed:
                self.log.flushed()
            return flushed

    def _concurrency(self) -> int:
        return self.config.max_concurrency or len(self.workload.conversations)

    async def run_pass(self, url: str, measured: bool, label: str) -> tuple[list[RequestRecord], float]:
        """Runs every conversation once; returns the records (empty unless `measured`) and the wall time."""
        records: list[RequestRecord] = []
        slots = asyncio.Semaphore(self._concurrency())
        starts = arrival_times(self.workload.conversations, self.config.request_rate, self.workload.params["seed"])
        with tqdm(total=self.workload.num_requests, desc=label, unit="req", disable=not self.config.progress) as bar:
            async with self._client(url) as client:
                start = time.perf_counter()

                async def conversation(conv: Conversation, arrival_s: float) -> None:
                    await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
                    async with slots:
                        answers: list[str] = []
                        for turn in range(len(conv.turns)):
                            record = None
                            if measured:
                                record = RequestRecord(
                                    self.arm.name, conv.conv_id, conv.group, turn + 1, time.perf_counter() - start
                                )
                                records.append(record)
                            answer = await self._request(client, conv, turn, answers, record, None)
                            bar.update(1)
                            if answer is None:
                                bar.update(len(conv.turns) - turn - 1)
                                return  # later turns need this answer
                            answers.append(answer)

                await asyncio.gather(*(conversation(c, t) for c, t in zip(self.workload.conversations, starts)))
                duration = time.perf_counter() - start
        return records, duration

    async def _request(
        self,
        client: httpx.AsyncClient,
        conv: Conversation,
        turn: int,
        answers: list[str],
        record: RequestRecord | None,
        max_tokens: int | None,
    ) -> str | None:
        """Sends one turn; returns the answer, or None when it failed (recorded, and logged once)."""
        messages = conversation_messages(conv, turn, answers)
        # The completions endpoint needs the rendered text now; for chat it is rendered after the run.
        prompt_text = self.tokenizer.chat_template.render(messages) if self.config.endpoint == "completions" else None
        output_len = conv.turns[turn].output_len if max_tokens is None else min(max_tokens, conv.turns[turn].output_len)
        path, body = build_payload(
            self.config.endpoint, self.model, messages, prompt_text or "", output_len, self.config.extra_body
        )
        sent = _Sent(messages, prompt_text, record)
        self.log.sent(sent)
        result = await stream_request(client, path, body)
        if record is not None:
            record.ttft_s = result.ttft_s
            record.latency_s = result.latency_s
            record.itl_s = result.itl_s
            record.prompt_tokens = result.prompt_tokens or 0
            record.output_tokens = result.completion_tokens or 0
            record.cached_tokens = result.cached_tokens or 0
            record.cached_tokens_by_tier = result.cached_tokens_by_tier
            record.spec_proposed_tokens = result.spec_proposed_tokens
            record.spec_accepted_tokens = result.spec_accepted_tokens
            record.transferred_tokens = result.transferred_tokens
            record.error = result.error
        if result.error is not None:
            logger.warning("conversation %d turn %d failed: %s", conv.conv_id, turn + 1, result.error)
            return None
        sent.answer = result.text
        self.log.answered(sent)
        return result.text


def arrival_times(conversations: Sequence[Conversation], rate: float, seed: object) -> list[float]:
    """Start times: a Poisson process of `rate` (seeded, so every arm gets the same schedule), never
    earlier than a conversation's own join time."""
    rng = random.Random(f"arrivals-{seed}")
    times, now = [], 0.0
    for conv in conversations:
        times.append(max(now, conv.start_offset_s))
        if math.isfinite(rate):
            now += rng.expovariate(rate)
    return times

