"""Serving: the bridge between asyncio request handlers and the engine's scheduler thread.

The scheduler thread hands each `RequestEvent` to a callback, which only schedules it onto the event
loop (`call_soon_threadsafe`); everything else happens on the loop thread. There the event is
accounted (metrics, per-choice state) whether or not a handler is still reading, then queued for the
handler. So a request whose client vanished is still counted, and the engine thread never blocks on
or races with a handler.

One `Generation` is one API request: one engine request per prompt, events merged into one stream.
Closing it cancels whatever has not finished, which is how a disconnected client frees its pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from hicache.cache import TIERS
from hicache.engine.engine import Engine, RequestHandle
from hicache.scheduler.request import Bootstrap, DisaggUsage, FinishReason, RequestEvent, SamplingParams, TokenLogprob
from hicache.server.errors import APIError
from hicache.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass
class Choice:
    """What one prompt of a generation has produced so far (updated on the loop thread)."""

    index: int
    handle: RequestHandle
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    spec_tokens: tuple[int, int] | None = None  # (proposed, accepted) draft tokens, with speculative decoding
    disagg: DisaggUsage | None = None  # a P/D decode server's account of the prompt's KV

    @property
    def prompt_tokens(self) -> int:
        return self.handle.prompt_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.handle.req.params.logprobs is not None


class Generation:
    def __init__(self, client: EngineClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop
        self._queue: asyncio.Queue[tuple[int, RequestEvent]] = asyncio.Queue()
        self.choices: list[Choice] = []

    def _submit(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        cache_salt: str,
        bootstrap: Bootstrap | None,
        priority: int = 0,
        retention_seconds: float | None = None,
    ) -> None:
        engine = self._client.engine
        try:
            for index, prompt in enumerate(prompts):
                callback = functools.partial(self._from_engine_thread, index)
                room = None if bootstrap is None else dataclasses.replace(bootstrap, room=bootstrap.room + index)
                handle = engine.submit(
                    prompt, params, cache_salt, on_event=callback, bootstrap=room, priority=priority,
                    retention_seconds=retention_seconds,
                )  # fmt: skip
                self.choices.append(Choice(index, handle))
                self._client.metrics.prompt_tokens.inc(handle.prompt_tokens)
        except BaseException:
            self.close()  # a batch is all or nothing: drop the prompts already submitted
            raise

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def _from_engine_thread(self, index: int, event: RequestEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_event, index, event)
        except RuntimeError:
            # The loop is closed: the process is exiting and nobody is waiting for this request.
            pass

    def _on_event(self, index: int, event: RequestEvent) -> None:
        choice = self.choices[index]
        metrics = self._client.metrics
        if event.disagg is not None:
            choice.disagg = event.disagg
        if event.cached_tokens_by_tier is not None:
            choice.cached_tokens_by_tier = dict(event.cached_tokens_by_tier)
            # On a P/D decode server these are prefill's hits, counted in prefill's metrics already.
            for tier, n in event.cached_tokens_by_tier.items() if event.disagg is None else ():
                metrics.cached_tokens.labels(tier=tier).inc(n)
        if event.new_token_ids:
            if not choice.token_ids:
                metrics.ttft.observe(time.perf_counter() - choice.handle.submitted)
            choice.token_ids.extend(event.new_token_ids)
            choice.logprobs.extend(event.logprobs)
            metrics.generation_tokens.inc(len(event.new_token_ids))
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.matched_stop = event.matched_stop
            choice.error = event.error
            choice.spec_tokens = event.spec_tokens
            metrics.requests.labels(status=event.finish_reason.value).inc()
            if self.finished:
                self._client._forget(self)
        self._queue.put_nowait((index, event))

    async def events(self) -> AsyncIterator[tuple[int, RequestEvent]]:
        """(choice index, event) in arrival order until every choice has finished. One reader only."""
        remaining = len(self.choices)
        while remaining:
            index, event = await self._queue.get()
            if event.finish_reason is not None:
                remaining -= 1
            yield index, event

    async def wait(self) -> list[Choice]:
        async for _ in self.events():
            pass
        return self.choices

    def close(self) -> None:
        """Cancel the prompts that have not finished; their pages go back to the pool. Idempotent."""
        for choice in self.choices:
            if choice.finish_reason is None:
                self._client.engine.cancel(choice.handle.rid)


class EngineClient:
    """The engine as the HTTP handlers see it: starts generations and tracks the live ones, so that a
    shutdown can abort them all at once instead of waiting for every stream to run to its end."""

    def __init__(self, engine: Engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.draining = False
        self._live: set[Generation] = set()

    def start(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        cache_salt: str,
        bootstrap: Bootstrap | None = None,
        priority: int = 0,
        retention_seconds: float | None = None,
    ) -> Generation:
        """Submit now (a bad prompt raises its UserError here, before any response is sent). `priority`,
        `retention_seconds`: the prompts' cache retention hint (Engine.submit)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        gen = Generation(self, asyncio.get_running_loop())
        gen._submit(prompts, params, cache_salt, bootstrap, priority, retention_seconds)
        self._live.add(gen)
        return gen

    def _forget(self, gen: Generation) -> None:
        self._live.discard(gen)

    def abort_all(self) -> None:
        """Refuse new generations and cancel every live one (graceful shutdown). Loop thread only."""
        self.draining = True
        if self._live:
            logger.info("shutting down: aborting %d in-flight generations", len(self._live))
        for gen in list(self._live):
            gen.close()
