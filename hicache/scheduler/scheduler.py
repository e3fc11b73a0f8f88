"""Continuous-batching scheduler of one rank: admission, chunked prefill, decode, prefix caching.

Each `step` runs one forward pass over a mixed batch: one token for every decoding request plus up to
`chunked_prefill_size` prompt tokens of requests being prefilled (continuing partial prefills first,
then admitting waiting requests in arrival order).

The scheduler talks to the cache only through the cache API (hicache/cache/api.py): every request gets
a `KVHandle` when it arrives (`req.kv`), the cache admits it with the pages it may ever need (prompt +
max new tokens; the memory invariant and the reservations are the cache's), gives it pages as chunks
are scheduled (`extend`), and takes everything back when it ends (`release`).

What is not plain comes from parts the scheduler holds, not from subclasses, so that any of them
combine by configuration: how a step is computed (`compute`, a `StepCompute`: the runner's plain pass
or speculative decoding, hicache/spec/decoder.py), and where requests come from and where their
results go (`role`, a `Role`: a P/D role, hicache/scheduler/role.py states the points it is called at;
none for one server doing everything). Pipeline stages are the runner's: every stage runs this
scheduler, and hidden states travel to the next stage inside the step (hicache/parallel/pipeline.py).

With several ranks every rank runs this scheduler on the same inputs (SPMD): the decisions below are
deterministic functions of its state, asynchronous results enter only through the cache's agreed
checks, and sampled tokens come from one rank, so every rank's state stays the same. The consensus
checker (hicache/debug/consensus_checker.py) compares the marked decisions at each step.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from hicache.cache import FailedLoads, KVCache, KVState
from hicache.config import EngineConfig
from hicache.debug.consensus_checker import ConsensusChecker, consensus_checked
from hicache.errors import RequestTooLargeError
from hicache.events import KVEventPublisher
from hicache.model.tokenizer import Tokenizer
from hicache.scheduler.model_runner import ModelRunner, StepCompute, WorkItem
from hicache.scheduler.request import FinishReason, Request, RequestEvent, TokenLogprob
from hicache.scheduler.role import Role

logger = logging.getLogger(__name__)

# A waiting request that shares at least this many not-yet-cached prompt tokens with a request still
# being prefilled waits for that prefill to land in the tree instead of computing the same tokens
# alongside it (SGLang's in-batch prefix caching does the same).
IN_BATCH_PREFIX_MIN_TOKENS = 32


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def check_request_fits(cfg: EngineConfig, context_length: int, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse at once what could never run, rather than letting it wait forever. Needs only the
    configuration, so the engine front checks requests before they reach any rank."""
    if prompt_len == 0:
        raise RequestTooLargeError("the prompt is empty")
    if prompt_len + max_new_tokens > context_length:
        raise RequestTooLargeError(
            f"prompt ({prompt_len} tokens) plus max new tokens ({max_new_tokens}) exceeds the context "
            f"length of {context_length} tokens"
        )
    need = _pages_for(prompt_len + max_new_tokens, cfg.page_size)
    what = f"prompt ({prompt_len} tokens) plus max new tokens ({max_new_tokens})"
    shards = cfg.parallel.cp_size
    if shards == 1:
        if need > cfg.num_pages:
            raise RequestTooLargeError(
                f"{what} needs {need} KV pages but the pool has {cfg.num_pages} (raise --max-total-tokens)"
            )
        if need > cfg.sliding_pages:  # a running request holds its sliding-window KV too (set for hybrids only)
            raise RequestTooLargeError(
                f"{what} needs {need} KV pages but the sliding-window pool has {cfg.sliding_pages} "
                "(raise --swa-full-tokens-ratio or --max-total-tokens)"
            )
        return
    # With CP each rank holds only its owner class of the request's pages, and admission counts class
    # by class (hicache/cache/page_budget.py): the tightest class must fit one rank's pool, not the total.
    per_rank = _most_pages_per_rank(need, shards)
    figures = f"{what} needs up to {per_rank} KV pages on each of the {shards} CP ranks ({need} in all)"
    pool = cfg.num_pages - 1  # a rank's local page 0 is its padding page (hicache/parallel/placement.py)
    if per_rank > pool:
        raise RequestTooLargeError(f"{figures} but each rank's pool has {pool} (raise --max-total-tokens)")
    # A request whose pages outgrow the gather's scratch alone could never be admitted
    # (hicache/cache/page_budget.py): refused here instead of waiting forever.
    gather = cfg.cp_gather_pages
    if gather is not None and per_rank > gather:
        raise RequestTooLargeError(f"{figures} but the CP gather holds {gather} per rank (raise --cp-gather-tokens)")


def _most_pages_per_rank(pages: int, shards: int) -> int:
    """The most of a request's `pages` logical pages that any one of `shards` ranks holds. Its pages
    cycle over the owner classes from a rotation base (page i on class (base + i) mod N), so whatever
    the base, the tightest class gets ceil(pages / N) of them."""
    return -(-pages // shards)


def _work_summary(namespace) -> list[tuple[int, int, int]]:
    return [(item.req.rid, item.start, item.end) for item in namespace["result"]]


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        runner: ModelRunner,
        cache: KVCache,
        tokenizer: Tokenizer,
        context_length: int,
        checker: ConsensusChecker | None = None,
        compute: StepCompute | None = None,
        role: Role | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        """`compute`: how a step's work is computed (speculative decoding, hicache/spec/); the runner's
        plain forward pass by default. `role`: a P/D role (hicache/disagg/roles.py); None serves a
        request here from its prompt to its end. `kv_events`: publishes what each step's cache changes
        stored and dropped (--kv-events-endpoint)."""
        self.cfg = cfg
        self.checker = checker if checker is not None else ConsensusChecker(env={})
        self.runner = runner
        self.compute: StepCompute = compute if compute is not None else runner
        self.cache = cache
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.page_size = cfg.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.role = role
        self.kv_events = kv_events

    # ---- intake --------------------------------------------------------------------------------

    def _pages_for(self, tokens: int) -> int:
        return _pages_for(tokens, self.page_size)

    def add(self, req: Request) -> None:
        if self.role is not None:
            self.role.add(self, req)
            return
        self.open(req)
        self.waiting.append(req)

    def open(self, req: Request) -> None:
        """Give `req` its KV handle (arrival: the cache only looks its prompt up)."""
        req.kv_handle = self.cache.open(req.rid, req.prompt_ids, req.namespace, req.retention)

    def abort(self, rid: int) -> None:
        for req in list(self.waiting) + self.running:
            if req.rid == rid:
                req.aborted = True
        if self.role is not None:
            self.role.abort(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or (self.role is not None and self.role.has_work)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestEvent]:
        events = self._step()
        self._publish_kv_events()
        return events

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish()

    def _step(self) -> list[RequestEvent]:
        events = self.role.intake(self) if self.role is not None else []
        self.cache.check()
        events += self._drop_aborted()
        work = self._schedule()
        # Every rank, every step, before any computation depends on the decisions just made.
        self.checker.checkpoint()
        if not work:
            return events
        outputs = self.compute.step(work, self.cache.before_layer())
        failed = self.cache.failed_loads()
        recomputing = self._recompute_failed_loads(failed) if failed else set()
        for item, out in zip(work, outputs):
            req = item.req
            if req.rid in recomputing:
                continue  # its step read pages a load never filled: computed again from waiting
            req.kv.advance(out.computed)
            if out.kept < out.computed:
                req.kv.truncate(out.kept)  # rejected speculative rows, in every pool the handle covers
            if not req.prompt_shared and req.kv.valid_len >= req.prompt_len:
                # Share the prompt with requests arriving meanwhile, once every pool holds it (a
                # speculative draft may catch up on it a step later).
                self.cache.cache_prefix(req.kv, req.prompt_ids)
                req.prompt_shared = True
            for token, logprob in out.tokens:
                events.append(self._append_token(req, token, logprob))
                if events[-1].finish_reason is not None:
                    break  # tokens a speculative step accepted past a stop are dropped
        return events

    def _recompute_failed_loads(self, failed: FailedLoads) -> set[int]:
        """Requests holding a page of a load that did not land (hicache/cache/failed_loads.py) go back
        to the front of the waiting queue, their step's output dropped, holding nothing; admitted again,
        they recompute from the last good page what the load was to bring. Then the cache takes the
        load's pages back. The rids sent back."""
        bad = failed.pages
        hit = [req for req in self.running if not bad.isdisjoint(req.kv.pages)]
        for req in hit:
            self.running.remove(req)
            kv = req.kv
            self.cache.release(kv, req.prompt_ids[: kv.kv_len])  # its prefix was the tree's already
            self.open(req)
            req.kv.load_host = False
            req.generator = None  # a seeded sampler starts again with the request
            logger.warning("request %d: a host -> device load failed; recomputing its prefix", req.rid)
        self.waiting.extendleft(reversed(hit))
        self.cache.drop_failed_loads(failed, len(hit))
        return {req.rid for req in hit}

    def _drop_aborted(self) -> list[RequestEvent]:
        events = []
        for req in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(req)
            self._release(req)
            events.append(RequestEvent(req.rid, (), finish_reason=FinishReason.ABORT))
        for req in [r for r in self.running if r.aborted]:
            self._finish(req)
            events.append(RequestEvent(req.rid, (), finish_reason=FinishReason.ABORT))
        return events

    @consensus_checked(results={"work": _work_summary})
    def _schedule(self) -> list[WorkItem]:
        work = [WorkItem(r, r.kv.kv_len, r.kv.kv_len + 1) for r in self.running if not r.in_prefill]
        budget = self.cfg.chunked_prefill_size
        for req in self.running:
            if req.in_prefill and budget > 0:
                n = min(req.prompt_len - req.kv.kv_len, budget)
                work.append(WorkItem(req, req.kv.kv_len, req.kv.kv_len + n))
                budget -= n
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            if not self.cache.ready_to_admit(req.kv, busy=bool(self.running)):
                continue  # its storage prefetch is still running; later arrivals may go first
            if self._prefix_in_flight(req):
                continue  # another request is computing its prefix right now; take it from the tree next
            if not self._admit(req):
                break  # first come, first served: no overtaking on memory
            self.waiting.remove(req)
            self.running.append(req)
            n = min(req.prompt_len - req.kv.kv_len, budget)
            work.append(WorkItem(req, req.kv.kv_len, req.kv.kv_len + n))
            budget -= n
        for item in work:
            self.cache.extend(item.req.kv, item.end)
        return work

    def _prefix_in_flight(self, req: Request) -> bool:
        """True if a request whose prompt is not in the tree yet is computing (beyond what it found
        cached) a prefix of at least IN_BATCH_PREFIX_MIN_TOKENS that `req` shares. Waiting costs nothing:
        that prefill is the work the engine does meanwhile, and a next step finds the prefix in the tree."""
        for other in self.running:
            if other.prompt_shared or other.namespace != req.namespace:
                continue
            shared = req.kv.packed_prompt.common_prefix(other.kv.packed_prompt)  # packed once per prompt
            if shared - other.cached_tokens >= IN_BATCH_PREFIX_MIN_TOKENS:
                return True
        return False

    def _admit(self, req: Request) -> bool:
        self._seed(req)
        return self.cache.admit(req.kv, self.pages_needed(req)).admitted

    def pages_needed(self, req: Request) -> int:
        """Every page `req` may ever need, its prompt and all it may generate: what admission reserves
        (the memory invariant, hicache/cache/prefix_cache.py)."""
        return self._pages_for(req.prompt_len + req.max_new_tokens)

    @staticmethod
    def _seed(req: Request) -> None:
        if req.params.seed is not None and req.generator is None:
            req.generator = torch.Generator().manual_seed(req.params.seed)

    def start_decoding(self, req: Request, token: int, logprob: TokenLogprob | None) -> RequestEvent:
        """A request whose prompt's KV was written from outside (its handle READY) joins the running
        batch with its first token, computed elsewhere; the event may already finish it."""
        self._seed(req)
        self.running.append(req)
        return self._append_token(req, token, logprob)

    def _append_token(self, req: Request, token: int, logprob: TokenLogprob | None) -> RequestEvent:
        req.output_ids.append(token)
        reason, matched = self._stop_reason(req, token)
        first = None if req.first_event_sent else req.kv.cached_tokens_by_tier
        req.first_event_sent = True
        if reason is not None:
            self._finish(req, logprob)
        return RequestEvent(
            req.rid,
            (token,),
            (logprob,) if logprob is not None else (),
            finish_reason=reason,
            matched_stop=matched,
            cached_tokens_by_tier=first,
            spec_tokens=(req.spec_proposed, req.spec_accepted) if reason and self.compute.speculative else None,
        )

    def _stop_reason(self, req: Request, token: int) -> tuple[FinishReason | None, str | int | None]:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            return FinishReason.STOP, token
        if p.stop:
            # Only the tail can contain a stop string that was not there one token ago.
            # A token carries at least one byte, so this many tokens cover the longest stop string.
            longest = max(len(s.encode("utf-8")) for s in p.stop)
            tail = self.tokenizer.decode(req.output_ids[-(longest + 8) :])
            for s in p.stop:
                if s in tail:
                    return FinishReason.STOP, s
        if len(req.output_ids) >= req.max_new_tokens or req.prompt_len + len(req.output_ids) >= self.context_length:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, req: Request, logprob: TokenLogprob | None = None) -> None:
        self.running.remove(req)
        self._release(req, logprob)

    def _release(self, req: Request, logprob: TokenLogprob | None = None) -> None:
        """Finished (`logprob`: of its last token), aborted or never admitted: the role hands on what
        it computed, then the cache keeps that and takes the rest back (later, through `release_kv`,
        when the role keeps the pages until a transfer has read them)."""
        if self.role is None or not self.role.release(self, req, logprob):
            self.release_kv(req)

    def release_kv(self, req: Request) -> None:
        """The cache keeps what a request that ended computed and takes the rest back."""
        kv = req.kv
        if kv.state is KVState.READY:
            # Only what every pool holds, up to the sequence's end, is shared: not speculative rows
            # computed past a stop, nor a last accepted token the draft has not computed yet.
            kv.truncate(max(kv.committed_len, min(kv.valid_len, req.prompt_len + len(req.output_ids))))
        self.cache.release(kv, req.tokens(kv.kv_len))

    def abort_all(self, reason: FinishReason, message: str) -> list[RequestEvent]:
        """End every request now, releasing its pages and locks (after a failed step, or at shutdown)."""
        events = self.role.abort_all(self, reason, message) if self.role is not None else []
        events += [RequestEvent(r.rid, (), finish_reason=reason, error=message) for r in [*self.waiting, *self.running]]
        for req in list(self.waiting):
            self._release(req)
        self.waiting.clear()
        for req in list(self.running):
            self._finish(req)
        return events

    # ---- maintenance ---------------------------------------------------------------------------

    def flush(self) -> bool:
        """Drop every cached prefix in memory. Refused (False) while requests are waiting or running."""
        if self.has_work:
            return False
        self.cache.flush()
        self._publish_kv_events()
        return True

    def leak_report(self) -> list[str]:
        """Problems a flush should have left none of: pages not back in the pool, nodes still locked,
        pages still promised."""
        return self.cache.leak_report()

    def close(self) -> None:
        """Stop what this scheduler started besides the cache (a P/D role's transfer endpoint)."""
        if self.role is not None:
            self.role.close()
        if self.kv_events is not None:
            self.kv_events.close()
