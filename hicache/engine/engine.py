"""`Engine`: the offline and serving front of hicache.

It loads the model, builds one rank's scheduler, and runs the scheduler loop on a background thread.
Callers submit prompts from any thread and receive `RequestEvent`s through a `RequestHandle` (a queue,
or a callback for asyncio servers). Tokenization and validation happen in the caller's thread, so a bad
request fails there with a `UserError` and never reaches the loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from hicache.cache.hicache import HierarchicalCache
from hicache.cache.prefix_cache import PrefixCache
from hicache.config import EngineConfig
from hicache.dist.consensus import Consensus
from hicache.dist.parallel import ParallelContext
from hicache.engine.model_runner import ModelRunner
from hicache.engine.request import FinishReason, Request, RequestEvent, SamplingParams, TokenLogprob, TIERS
from hicache.engine.scheduler import Scheduler
from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.llama import LlamaModel
from hicache.model.loader import load_model

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    rid: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str | None = None

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "cached_tokens": self.cached_tokens,
            "cached_tokens_by_tier": self.cached_tokens_by_tier,
            "finish_reason": self.finish_reason,
            "ttft_s": round(self.ttft_s, 6),
            "latency_s": round(self.latency_s, 6),
        }


class RequestHandle:
    """Events of one request, in order. Iterate for streaming, or call `result()` to wait for the end."""

    def __init__(self, engine: "Engine", req: Request, on_event: Callable[[RequestEvent], None] | None) -> None:
        self.engine = engine
        self.req = req
        self.rid = req.rid
        self.prompt_tokens = req.prompt_len
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._events: queue.Queue[RequestEvent] = queue.Queue()
        self._on_event = on_event

    def _deliver(self, event: RequestEvent) -> None:
        if self.first_token_at is None and event.new_token_ids:
            self.first_token_at = time.perf_counter()
        if self._on_event is not None:
            self._on_event(event)
        else:
            self._events.put(event)

    def __iter__(self):
        while True:
            event = self._events.get()
            yield event
            if event.finish_reason is not None:
                return

    def cancel(self) -> None:
        self.engine.cancel(self.rid)

    def result(self) -> GenerationResult:
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        tiers = dict.fromkeys(TIERS, 0)
        last = None
        for event in self:
            tokens.extend(event.new_token_ids)
            logprobs.extend(event.logprobs)
            if event.cached_tokens_by_tier is not None:
                tiers = event.cached_tokens_by_tier
            last = event
        assert last is not None
        end = time.perf_counter()
        return GenerationResult(
            rid=self.rid,
            text=self.engine.detokenize(tokens, last.matched_stop),
            token_ids=tokens,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=sum(tiers.values()),
            cached_tokens_by_tier=tiers,
            finish_reason=last.finish_reason.value if last.finish_reason else "abort",
            logprobs=logprobs,
            ttft_s=(self.first_token_at or end) - self.submitted,
            latency_s=end - self.submitted,
            error=last.error,
        )


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        cfg = replace(config or EngineConfig(), **overrides)
        self.config = cfg
        cfg.log()
        loaded = load_model(cfg.model)
        self.model_name = loaded.name
        self.model_identity = loaded.identity
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.context_length = min(cfg.context_length or loaded.config.max_position, loaded.config.max_position)
        pctx = ParallelContext()
        device, dtype = cfg.resolved_device(), cfg.resolved_dtype()
        model = LlamaModel(loaded.config, loaded.weights, pctx, dtype, device)
        del loaded
        pool = DeviceKVPool(model.kv_layout, model.num_local_layers, cfg.num_pages, cfg.page_size, dtype, device)
        cache: PrefixCache
        if cfg.hicache.enable_hierarchical_cache:
            cache = HierarchicalCache(pool, cfg.hicache, Consensus(pctx), self.model_identity, pctx.suffix)
        else:
            cache = PrefixCache(pool, enabled=not cfg.disable_radix_cache)
        self.scheduler = Scheduler(cfg, ModelRunner(model, pool), cache, self.tokenizer, self.context_length)
        self._handles: dict[int, RequestHandle] = {}
        self._inbox: list[Request] = []
        self._control: list[tuple[Callable[[], object], Future]] = []
        self._cancels: list[int] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="hicache-scheduler", daemon=True)
        self._thread.start()

    # ---- client side ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.tokenizer.vocab_size]
        if bad:
            raise UserError(f"token ids outside the vocabulary (0..{self.tokenizer.vocab_size - 1}): {bad[:5]}")
        return ids

    def detokenize(self, tokens: Sequence[int], matched_stop: str | int | None = None) -> str:
        if isinstance(matched_stop, int) and tokens and tokens[-1] == matched_stop:
            tokens = tokens[:-1]  # OpenAI leaves the stop token out of the text
        text = self.tokenizer.decode(tokens)
        if isinstance(matched_stop, str):
            text = text[: text.find(matched_stop)] if matched_stop in text else text
        return text

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str = "",
        on_event: Callable[[RequestEvent], None] | None = None,
    ) -> RequestHandle:
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        max_new = params.max_new_tokens or min(self.config.default_max_new_tokens, max(1, self.context_length - len(ids)))
        self.scheduler.validate(len(ids), max_new)
        req = Request(ids, params, max_new, namespace=cache_salt)
        handle = RequestHandle(self, req, on_event)
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            self._handles[req.rid] = handle
            self._inbox.append(req)
            self._wake.notify()
        return handle

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None, cache_salt: str = ""
    ) -> list[GenerationResult]:
        """Runs the prompts concurrently (one batch) and returns their results in order."""
        handles = [self.submit(p, params, cache_salt) for p in prompts]
        return [h.result() for h in handles]

    def cancel(self, rid: int) -> None:
        with self._wake:
            self._cancels.append(rid)
            self._wake.notify()

    def call_in_loop(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the scheduler thread between two steps and return its result."""
        fut: Future = Future()
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            self._control.append((fn, fut))
            self._wake.notify()
        return fut.result()

    def flush_cache(self) -> bool:
        return bool(self.call_in_loop(self.scheduler.flush))

    def leak_report(self) -> list[str]:
        return self.call_in_loop(self.scheduler.leak_report)  # type: ignore[return-value]

    def pool_usage(self) -> dict[str, tuple[int, int]]:
        """(used, capacity) in tokens per memory tier that exists."""
        return self.scheduler.cache.usage()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    def cache_stats(self) -> dict[str, float]:
        """Counters of the cache tiers (transfers, prefetch lifecycle, storage hits and corruption)."""
        return self.call_in_loop(self.scheduler.cache.stats)  # type: ignore[return-value]

    def shutdown(self) -> None:
        with self._wake:
            if self._stopped:
                return
            self._stopped = True
            self._wake.notify()
        self._thread.join()
        self.scheduler.cache.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- scheduler thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                while not (self._stopped or self._inbox or self._control or self._cancels or self.scheduler.has_work):
                    self._wake.wait()
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
                control, self._control = self._control, []
                cancels, self._cancels = self._cancels, []
            for req in inbox:
                self.scheduler.add(req)
            for rid in cancels:
                self.scheduler.abort(rid)
            for fn, fut in control:
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            try:
                events = self.scheduler.step()
            except Exception as exc:
                logger.exception("scheduler step failed; failing every in-flight request")
                events = self._fail_all(f"internal error: {exc}")
            for event in events:
                self._dispatch(event)
            if self.scheduler.waiting and not self.scheduler.running:
                # Requests wait on something asynchronous (a storage prefetch): poll gently, so the
                # transfer threads get the CPU, and wake at once for anything new.
                with self._wake:
                    self._wake.wait(timeout=0.002)
        self._fail_all_on_shutdown()

    def _dispatch(self, event: RequestEvent) -> None:
        handle = self._handles.get(event.rid)
        if handle is None:
            return
        if event.finish_reason is not None:
            del self._handles[event.rid]
        handle._deliver(event)

    def _fail_all(self, message: str) -> list[RequestEvent]:
        return self.scheduler.abort_all(FinishReason.ERROR, message)

    def _fail_all_on_shutdown(self) -> None:
        for event in self._fail_all("the engine was shut down"):
            self._dispatch(event)
        with self._wake:
            control, self._control = self._control, []
        for _, fut in control:
            fut.set_exception(RuntimeError("the engine is shut down"))
