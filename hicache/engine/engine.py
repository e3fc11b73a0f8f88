"""`Engine`: the offline and serving front of hicache (docs/DESIGN.md, "engine").

It loads the tokenizer and model configuration and starts a runtime (base.Runtime): at one rank, the
scheduler loop on a background thread of this process (local.py); with --tp-size x --pp-size > 1, one
process per rank running the same scheduler in lockstep (rank_front.py). Callers submit prompts from any
thread and receive `RequestEvent`s through a `RequestHandle` (a queue, or a callback for asyncio
servers). Tokenization and validation happen in the caller's thread, so a bad request fails there with
a `UserError` and never reaches a scheduler. If a rank dies, every in-flight request fails with the
reason, the engine refuses new work, and `on_fatal` callbacks run (the server exits on them).

The front chooses the runtime, so it sits beside the runtimes in this package, above the scheduler
they run (hicache/scheduler/). The server and the benchmark build on it, and `hicache` re-exports it
(`from hicache import Engine`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence, TypeVar

from hicache.cache import TIERS, CacheStats, Retention, storage_layout
from hicache.config import EngineConfig
from hicache.disagg.stats import DisaggStats
from hicache.engine.base import Runtime, check_usable
from hicache.engine.build import build_scheduler, check_hybrid, check_topology, context_length, load_engine_model
from hicache.engine.commands import DISAGG_INFO, FLUSH, INVARIANCE, LEAK_REPORT, SNAPSHOT, Command
from hicache.engine.deadlines import DeadlineWatch
from hicache.engine.local import LocalRuntime
from hicache.engine.rank_front import RankRuntime
from hicache.engine.snapshot import Snapshot
from hicache.parallel.threads import cpu_threads, on_own_thread, use_threads
from hicache.errors import UserError
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.request import (
    Bootstrap,
    DisaggUsage,
    FinishReason,
    Request,
    RequestEvent,
    SamplingParams,
    TokenLogprob,
)
from hicache.scheduler.scheduler import Scheduler, check_request_fits
from hicache.spec.stats import SpecStats

logger = logging.getLogger(__name__)


A = TypeVar("A")
T = TypeVar("T")


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
    spec_tokens: tuple[int, int] | None = None  # (proposed, accepted) draft tokens, with speculative decoding
    disagg: DisaggUsage | None = None  # a P/D decode server's account of the prompt's KV

    def to_json(self) -> dict:
        spec = {}
        if self.spec_tokens is not None:
            spec = {"spec_proposed_tokens": self.spec_tokens[0], "spec_accepted_tokens": self.spec_tokens[1]}
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
            **spec,
        }


class RequestHandle:
    """Events of one request, in order. Iterate for streaming, or call `result()` to wait for the end."""

    def __init__(self, engine: "Engine", req: Request, on_event: Callable[[RequestEvent], None] | None, stream: bool):
        self.engine = engine
        self.req = req
        self.rid = req.rid
        self.prompt_tokens = req.prompt_len
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._events: queue.Queue[RequestEvent] = queue.Queue()
        self._on_event = on_event
        # Not streamed: every event before the last is held here and only the last wakes the reader.
        self._held: list[RequestEvent] | None = None if stream else []

    def _deliver(self, event: RequestEvent) -> None:
        if self.first_token_at is None and event.new_token_ids:
            self.first_token_at = time.perf_counter()
        if self._on_event is not None:
            self._on_event(event)
        elif self._held is not None and event.finish_reason is None:
            self._held.append(event)
        else:
            self._events.put(event)

    def __iter__(self):
        while True:
            event = self._events.get()
            if event.finish_reason is not None:  # put after every held one: all are in
                yield from [*(self._held or ()), event]
                return
            yield event

    def cancel(self) -> None:
        self.engine.cancel(self.rid)

    def result(self) -> GenerationResult:
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        tiers = dict.fromkeys(TIERS, 0)
        last = disagg = None
        spec = None
        for event in self:
            spec = event.spec_tokens or spec
            tokens.extend(event.new_token_ids)
            logprobs.extend(event.logprobs)
            if event.cached_tokens_by_tier is not None:
                tiers = event.cached_tokens_by_tier
            disagg = event.disagg or disagg
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
            spec_tokens=spec,
            disagg=disagg,
        )


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        requested = replace(config or EngineConfig(), **overrides)  # its `--dtype auto` resolved on loading:
        cfg, loaded = on_own_thread(lambda: load_engine_model(requested))
        self.config = cfg
        cfg.log()
        self.model_name = loaded.name
        self.model_identity = loaded.identity
        self.weight_format, self.weight_kernels = loaded.extra["weight_format"], loaded.extra["weight_kernels"]
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.context_length = context_length(cfg, loaded.config)
        check_hybrid(cfg, loaded)
        self._handles: dict[int, RequestHandle] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self.fatal_error: str | None = None
        self._fatal_callbacks: list[Callable[[str], None]] = []
        # Only here does the topology pick a runtime; everything else goes through the Runtime protocol.
        self._runtime: Runtime
        if cfg.parallel.world_size == 1:
            threads = cpu_threads(1)

            def build() -> Scheduler:
                use_threads(threads)  # where the model is built and calibrated, as where it runs
                return build_scheduler(cfg, loaded, ParallelContext())

            self._runtime = LocalRuntime(on_own_thread(build), self._dispatch, threads)
        else:
            check_topology(cfg, loaded.config)
            del loaded  # every rank loads its own shard; the weights are not kept here meanwhile
            self._runtime = RankRuntime(cfg, self._dispatch, self._fail)
        # What the start-up batch-invariance self-check found on every rank: `verified`, each op's
        # mechanism, and what differed where it failed (hicache/model/kernels/invariance.py). Fixed from here on.
        self.invariance = self._runtime.control(INVARIANCE)
        self._deadlines = DeadlineWatch(cfg.request_timeout, self._expire) if cfg.request_timeout > 0 else None

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
        bootstrap: Bootstrap | None = None,
        priority: int = 0,
        retention_seconds: float | None = None,
        stream: bool = True,
    ) -> RequestHandle:
        """`bootstrap`: where this request's prefill-decode pair meets (required on a P/D server, set by
        `hicache router`; ignored by a server that does everything itself). `priority` and
        `retention_seconds`: the request's cache retention hint (docs/DESIGN.md, "retention hints"):
        what it matches and caches is evicted after lower priorities, until that long past its last
        use by this request (None: no limit). Raises UserError for a priority below 0 or a negative
        or non-finite number of seconds. `stream=False`: the handle wakes its reader once, at the end, with
        every event (`result()`), not each token, which takes a core from the step (~3 % of decode on 2)."""
        try:  # stamped with its arrival: the clock retention lapses on, the same on every rank
            retention = Retention(priority, retention_seconds, since=time.monotonic())
        except ValueError as exc:
            raise UserError(str(exc)) from None
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        max_new = params.max_new_tokens or min(
            self.config.default_max_new_tokens, max(1, self.context_length - len(ids))
        )
        check_request_fits(self.config, self.context_length, len(ids), max_new)
        mode = self.config.disagg.disaggregation_mode
        if self.config.disagg.enabled and bootstrap is None:
            raise UserError(
                f"this is a {mode} server of a prefill-decode deployment: send requests through `hicache router`"
            )
        req = Request(
            ids, params, max_new, namespace=cache_salt, bootstrap=bootstrap if mode != "null" else None,
            retention=retention,
        )  # fmt: skip
        handle = RequestHandle(self, req, on_event, stream)
        with self._lock:
            self._check_alive()
            self._handles[req.rid] = handle
            self._runtime.submit(req)
        if self._deadlines is not None:
            self._deadlines.start(req.rid)
        return handle

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None, cache_salt: str = ""
    ) -> list[GenerationResult]:
        """Runs the prompts concurrently (one batch) and returns their results in order."""
        handles = [self.submit(p, params, cache_salt, stream=False) for p in prompts]
        return [h.result() for h in handles]

    def cancel(self, rid: int) -> None:
        self._runtime.cancel(rid)

    def call_in_loop(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the scheduler thread between two steps and return its result (one rank only:
        with several ranks the schedulers live in other processes; use the named commands)."""
        if not isinstance(self._runtime, LocalRuntime):
            raise RuntimeError("call_in_loop needs the single-rank engine (tp_size = pp_size = 1)")
        with self._lock:
            self._check_alive()
        return self._runtime.call(fn)

    def _control(self, command: Command[A, T]) -> T:
        with self._lock:
            self._check_alive()
        return self._runtime.control(command)

    def flush_cache(self) -> bool:
        return self._control(FLUSH)

    def leak_report(self) -> list[str]:
        return self._control(LEAK_REPORT)

    def snapshot(self) -> Snapshot:
        """Every counter of every rank, taken between two steps in one command (what a scrape reads)."""
        return self._control(SNAPSHOT).with_queues(self.num_running, self.num_waiting)

    def pool_usage(self) -> dict[str, tuple[int, int]]:
        """(used, capacity) in tokens per memory tier that exists."""
        return self.snapshot().pool_usage

    @property
    def num_running(self) -> int:
        return self._runtime.num_running

    @property
    def num_waiting(self) -> int:
        return self._runtime.num_waiting

    def kv_bytes_by_rank(self) -> dict[str, dict[str, int]]:
        """Per rank (by its tp/pp/cp name): the KV bytes it holds on the device and host tiers, and its
        CP gather scratch."""
        return self.snapshot().kv_bytes_by_rank

    def cache_stats(self) -> CacheStats:
        """Counters of the cache tiers (transfers, prefetch lifecycle, storage hits and corruption)."""
        return self.snapshot().cache

    def spec_stats(self) -> SpecStats | None:
        """Counters of speculative decoding (proposed, accepted, recomputed draft tokens); None without it."""
        return self.snapshot().spec

    def disagg_info(self) -> dict:
        """This server's P/D role, transfer endpoint and rank-0 handshake (hicache/disagg/roles.py)."""
        return self._control(DISAGG_INFO)

    def storage_layout(self) -> dict:
        """The storage key scheme and, for the unified layout, its namespace and grid (engine/build.py)."""
        return storage_layout(self.config, self.model_config, self.model_identity)

    def disagg_stats(self) -> DisaggStats | None:
        """P/D transfer counters (None on a server without a role)."""
        return self.snapshot().disagg

    def on_fatal(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (from a background thread) if a rank dies or ranks diverge."""
        self._fatal_callbacks.append(callback)

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._deadlines is not None:
            self._deadlines.stop()
        self._runtime.shutdown()
        self._fail_open_handles("the engine was shut down")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- runtime side --------------------------------------------------------------------------

    def _check_alive(self) -> None:
        check_usable(self.fatal_error, self._stopped)

    def _dispatch(self, event: RequestEvent) -> None:
        with self._lock:
            handle = self._handles.get(event.rid)
            if handle is None:
                return  # finished already, or timed out (its cancel's abort event ends here)
            if event.finish_reason is not None:
                del self._handles[event.rid]
        if event.finish_reason is not None and self._deadlines is not None:
            self._deadlines.finished(event.rid)
        handle._deliver(event)

    def _expire(self, rid: int) -> None:
        """--request-timeout passed: the client hears it now, the scheduler releases the request's pages
        and locks when it takes the cancel in (at once, unless a step is running)."""
        with self._lock:
            handle = self._handles.pop(rid, None)
        if handle is None:
            return
        try:
            self._runtime.cancel(rid)
        except RuntimeError:
            pass  # the runtime is gone: nothing is held any more
        timeout = self.config.request_timeout
        message = f"the request did not finish within --request-timeout {timeout:g} s and was aborted"
        logger.warning("request %d timed out after %g s", rid, timeout)
        handle._deliver(RequestEvent(rid, (), finish_reason=FinishReason.TIMEOUT, error=message))

    def _fail(self, reason: str) -> None:
        """A rank died or ranks diverged: fail everything in flight and refuse new work."""
        with self._lock:
            if self.fatal_error is not None:
                return
            self.fatal_error = reason
        logger.error("engine failed: %s", reason)
        self._fail_open_handles(reason)
        for callback in self._fatal_callbacks:
            callback(reason)

    def _fail_open_handles(self, message: str) -> None:
        with self._lock:
            handles, self._handles = self._handles, {}
        for rid, handle in handles.items():
            handle._deliver(RequestEvent(rid, (), finish_reason=FinishReason.ERROR, error=message))
