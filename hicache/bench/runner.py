"""Runs a benchmark (the `bench` part of the design): for each arm, start its server (or use a given
URL), warm up, flush, optionally run a warming pass and restart the server, then measure one pass of the
workload and summarize it. `run_bench` is the Python entry point (`hicache demo` builds on it).

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

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import httpx
from tqdm import tqdm

from hicache.bench.client import ENDPOINTS, build_payload, flush_cache, served_model, stream_request
from hicache.bench.launcher import ServerProcess, check_serve_args
from hicache.bench.metrics import IdealCache, RequestRecord, summarize
from hicache.bench.workload import (
    Conversation,
    GSPParams,
    MultiRoundParams,
    Workload,
    build_workload,
    conversation_messages,
    load_tokenizer,
)
from hicache.errors import UserError
from hicache.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Warm-up requests only have to reach every code path once; long outputs would just cost time.
WARMUP_MAX_TOKENS = 16


@dataclass(frozen=True)
class Arm:
    """One configuration to measure. `serve_args` are `hicache serve` flags for a fresh server; None
    targets `BenchConfig.base_url`. With `warm_then_restart`, the workload runs once, the server is
    restarted with the same flags (nothing flushed), and the second pass is measured: what it hits
    beyond a cold pass survived the restart (the storage tier)."""

    name: str
    serve_args: tuple[str, ...] | None = None
    warm_then_restart: bool = False

    def __post_init__(self) -> None:
        if self.serve_args is not None:
            object.__setattr__(self, "serve_args", tuple(self.serve_args))  # a list is fine too
            check_serve_args(self.serve_args)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: a workload run on every arm in turn. Field names follow the CLI flags."""

    workload: GSPParams | MultiRoundParams
    arms: tuple[Arm, ...]
    base_url: str | None = None
    endpoint: str = "completions"
    model: str | None = None  # the requests' "model"; defaults to the arm's --model or GET /v1/models
    tokenizer: str | None = None  # defaults to the model
    max_concurrency: int | None = None  # None: every conversation at once
    request_rate: float = math.inf
    flush_cache: bool = False
    warmup_requests: int = 1
    # Exact output lengths need the server to ignore EOS; every common open server accepts this field.
    extra_body: dict[str, Any] = field(default_factory=lambda: {"ignore_eos": True})
    output_file: str | None = None
    request_timeout_s: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.arms:
            raise UserError("a benchmark needs at least one arm")
        names = [arm.name for arm in self.arms]
        if len(set(names)) != len(names):
            raise UserError(f"arm names must be unique, got {names}")
        for arm in self.arms:
            if arm.serve_args is None and self.base_url is None:
                raise UserError(f"arm {arm.name!r} has no serve flags and there is no --base-url")
            if arm.serve_args is None and arm.warm_then_restart:
                raise UserError(f"arm {arm.name!r}: warm-then-restart needs a launched server, not --base-url")
        if self.endpoint not in ENDPOINTS:
            raise UserError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise UserError(f"--max-concurrency must be positive, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise UserError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if self.warmup_requests < 0:
            raise UserError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")
        if self.request_timeout_s <= 0:
            raise UserError(f"--request-timeout must be positive, got {self.request_timeout_s}")


def serve_model(serve_args: Sequence[str]) -> tuple[str, str]:
    """(model, served name) of a `hicache serve` command line: `--model` (the engine's default when
    absent) loads the tokenizer, `--served-model-name` (default: the model) goes into requests."""
    from hicache.config import EngineConfig

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", "--model-path", dest="model", default=EngineConfig().model)
    parser.add_argument("--served-model-name", default=None)
    known = parser.parse_known_args(list(serve_args))[0]
    return known.model, known.served_model_name or known.model


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


class _ArmSession:
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
        arrivals = _arrivals(self.workload.conversations, self.config.request_rate, self.workload.params["seed"])
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

                await asyncio.gather(*(conversation(c, t) for c, t in zip(self.workload.conversations, arrivals)))
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
            record.error = result.error
        if result.error is not None:
            logger.warning("conversation %d turn %d failed: %s", conv.conv_id, turn + 1, result.error)
            return None
        sent.answer = result.text
        self.log.answered(sent)
        return result.text


def _arrivals(conversations: Sequence[Conversation], rate: float, seed: object) -> list[float]:
    """Start times: a Poisson process of `rate` (seeded, so every arm gets the same schedule), never
    earlier than a conversation's own join time."""
    rng = random.Random(f"arrivals-{seed}")
    times, now = [], 0.0
    for conv in conversations:
        times.append(max(now, conv.start_offset_s))
        if math.isfinite(rate):
            now += rng.expovariate(rate)
    return times


def _arm_model(config: BenchConfig, arm: Arm, url: str | None, transport: httpx.AsyncBaseTransport | None) -> str:
    if config.model is not None:
        return config.model
    if arm.serve_args is not None:
        return serve_model(arm.serve_args)[1]

    async def ask() -> str:
        async with httpx.AsyncClient(base_url=url, transport=transport, timeout=30.0) as client:
            return await served_model(client)

    return asyncio.run(ask())


def _run_arm(
    config: BenchConfig,
    arm: Arm,
    workload: Workload,
    tokenizer: Tokenizer,
    transport: httpx.AsyncBaseTransport | None,
    out: IO[str] | None,
) -> dict:
    server = ServerProcess(arm.serve_args) if arm.serve_args is not None else None
    if server is not None:
        server.start()
    try:
        url = server.url if server is not None else config.base_url
        assert url is not None
        model = _arm_model(config, arm, url, transport)
        session = _ArmSession(config, arm, workload, tokenizer, model, transport)
        flushed = asyncio.run(session.warm_up_and_flush(url))
        if arm.warm_then_restart:
            assert server is not None
            asyncio.run(session.run_pass(url, measured=False, label=f"{arm.name} (warming pass)"))
            server.restart()
            url = server.url
        records, duration = asyncio.run(session.run_pass(url, measured=True, label=arm.name))
    finally:
        if server is not None:
            server.stop()
    session.log.replay(tokenizer)
    mismatched = sum(1 for r in records if r.ok and r.prompt_tokens != r.prompt_tokens_client)
    if mismatched:
        logger.warning(
            "arm %s: %d requests where the server counted other prompt tokens than the benchmark's tokenizer "
            "(another chat template or tokenizer?); ideal hit rates are approximate",
            arm.name,
            mismatched,
        )
    summary = summarize(
        arm.name,
        records,
        duration,
        {
            "dataset": workload.dataset,
            "workload": workload.params,
            "num_rounds": workload.num_rounds,
            "endpoint": config.endpoint,
            "model": model,
            "serve_args": list(arm.serve_args) if arm.serve_args is not None else None,
            "base_url": config.base_url if arm.serve_args is None else None,
            "warm_then_restart": arm.warm_then_restart,
            "max_concurrency": config.max_concurrency,
            "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
            "warmup_requests": config.warmup_requests,
            "flushed": flushed,
        },
    )
    if out is not None:
        for record in records:
            out.write(json.dumps(record.to_json()) + "\n")
        out.write(json.dumps(summary) + "\n")
        out.flush()
    logger.info(
        "arm %s: %d ok, %d failed, hit rate %s (ideal %s)",
        arm.name,
        summary["completed"],
        summary["failed"],
        summary["hit_rate"],
        summary["ideal_hit_rate"],
    )
    return summary


def resolve_tokenizer_name(config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> str:
    if config.tokenizer is not None:
        return config.tokenizer
    if config.model is not None:
        return config.model
    first = config.arms[0]
    if first.serve_args is not None:
        return serve_model(first.serve_args)[0]
    return _arm_model(config, first, config.base_url, transport)


def run_bench(config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> list[dict]:
    """Runs every arm of `config` on the same workload, in order; returns one summary dict per arm and,
    with `output_file`, writes each arm's request rows and summary row as it finishes. `transport`
    replaces the network (tests)."""
    tokenizer = load_tokenizer(resolve_tokenizer_name(config, transport))
    workload = build_workload(config.workload, tokenizer)
    with contextlib.ExitStack() as stack:
        out = None
        if config.output_file:
            try:
                out = stack.enter_context(open(config.output_file, "w", encoding="utf-8"))
            except OSError as exc:
                raise UserError(f"cannot write --output-file: {exc.strerror}: {config.output_file}") from None
        return [_run_arm(config, arm, workload, tokenizer, transport, out) for arm in config.arms]
