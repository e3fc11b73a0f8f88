"""P/D disaggregation: the decode role, the part of the scheduler (hicache/scheduler/role.py) that serves
the generation half of a request.

A request arrives with its bootstrap information and waits, first come first served, for decode-side
admission through the cache API (`KVCache.reserve`: match decode's own tree over the whole prompt, lock,
re-check the budget, reserve, restore the host part; docs/DESIGN.md, "P/D decode reuse", Figure 5).
Once reserved it tells prefill its decode_prefix_len and receives the rest of the prompt's KV straight
into its reserved pages while its host part restores. When every rank has both (agreement.py) it
becomes READY, its prompt is shared through the tree, and it joins the running batch as a decoding
request whose first token is prefill's. If either part fails, or the client goes away, it is released
from RESERVED with the reason: its pages, locks and promise go back, and prefill is told.

Only the first event of a request is special: it carries prefill's cached-token counts (what the client
is billed as cached; decode's own prefix is reported apart, as `DisaggUsage`), so `cached_tokens` can
never count a prompt token twice.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from hicache.cache import PrefixMatch, RestoreState
from hicache.disagg.agreement import agree_min
from hicache.disagg.handshake import Handshake
from hicache.disagg.stats import DisaggStats
from hicache.disagg.transfer import DecodeMetadata, KVPoll, KVReceiver, KVTransferBackend
from hicache.disagg.wire import prompt_digest
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.request import DisaggUsage, FinishReason, Request, RequestEvent, TokenLogprob
from hicache.scheduler.role import checked_intake
from hicache.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

FAILED, PENDING, DONE = 0, 1, 2  # a transfer's state as the ranks agree on it (MIN: any failure wins)


@dataclass(eq=False)
class Incoming:
    """A request on its way in: waiting for admission, then receiving and restoring."""

    req: Request
    receiver: KVReceiver

    @property
    def by_tier(self) -> PrefixMatch:
        """The prefix decode serves from its tree, by the tier it came from (set by `reserve`)."""
        return self.req.kv.cached

    @property
    def decode_prefix_len(self) -> int:
        """Tokens decode serves from its tree (page-aligned); prefill sends the KV after them. With a
        speculative draft it is the MIN over the target's and the draft's pools: every tree page holds
        both models' state, restored together (docs/DESIGN.md, "Speculation x P/D")."""
        return self.by_tier.total


class DecodeRole:
    """This rank's decode role over its transfer backend; transfer outcomes are agreed over `pctx`."""

    def __init__(self, transfer: KVTransferBackend, pctx: ParallelContext, handshake: Handshake) -> None:
        self.transfer = transfer
        self.pctx = pctx
        self.handshake = handshake
        self.counters = DisaggStats("decode")
        self.incoming: list[Incoming] = []  # waiting for decode-side admission, in arrival order
        self.transferring: list[Incoming] = []  # RESERVED: the suffix arriving, the host part restoring

    # ---- intake --------------------------------------------------------------------------------

    def add(self, scheduler: Scheduler, req: Request) -> None:
        if req.bootstrap is None:
            raise RuntimeError(f"request {req.rid} reached a decode server without bootstrap information")
        scheduler.open(req)
        self.incoming.append(Incoming(req, self.transfer.receiver(req.bootstrap)))

    def abort(self, rid: int) -> None:
        for inc in self.incoming + self.transferring:
            if inc.req.rid == rid:
                inc.req.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.incoming or self.transferring)

    # ---- each step, before the batch -------------------------------------------------------------

    @checked_intake
    def intake(self, scheduler: Scheduler) -> list[RequestEvent]:
        return self._admit_incoming(scheduler) + self._land(scheduler)

    def _admit_incoming(self, scheduler: Scheduler) -> list[RequestEvent]:
        cache = scheduler.cache
        cancelled = [inc for inc in self.incoming if inc.req.aborted]
        events = [self._end(scheduler, inc, FinishReason.ABORT, "the request was cancelled") for inc in cancelled]
        self.incoming = [inc for inc in self.incoming if not inc.req.aborted]
        busy = bool(scheduler.running or self.transferring)
        for inc in list(self.incoming):
            req = inc.req
            if len(scheduler.running) + len(self.transferring) >= scheduler.cfg.max_running_requests:
                break
            if not cache.ready_to_admit(req.kv, busy=busy):
                continue  # its storage prefetch is still running; later arrivals may go first
            if not cache.reserve(req.kv, scheduler.pages_needed(req)).admitted:
                break  # first come, first served: no overtaking on memory
            self.incoming.remove(inc)
            d = inc.decode_prefix_len
            pool = scheduler.runner.pool
            slots = pool.allocator.slots(req.kv.pages, req.prompt_len)[d:].to(pool.device)
            room = inc.receiver.room
            inc.receiver.init(
                slots, DecodeMetadata(room, d, req.prompt_len, prompt_digest(req.prompt_ids), self.handshake)
            )
            self.transferring.append(inc)
        return events

    def _local_status(self, scheduler: Scheduler, inc: Incoming) -> tuple[int, str | None]:
        status = inc.receiver.poll()
        if status is KVPoll.FAILED:
            return FAILED, inc.receiver.failure()
        restore = scheduler.cache.restore_status(inc.req.kv)
        if restore.state is RestoreState.FAILED:
            return FAILED, (
                f"decode could not restore the {inc.by_tier.host + inc.by_tier.storage}-token host part of the "
                f"prefix it promised prefill: {restore.error}"
            )
        return (DONE if status is KVPoll.SUCCESS and restore.state is RestoreState.LANDED else PENDING), None

    def _land(self, scheduler: Scheduler) -> list[RequestEvent]:
        """Requests whose suffix and restore are done on every rank start decoding; failed ones end."""
        if not self.transferring:
            return []
        local = [self._local_status(scheduler, inc) for inc in self.transferring]
        prefixes = [inc.decode_prefix_len for inc in self.transferring]
        agreed = agree_min(self.pctx, [status for status, _ in local], equal=prefixes)
        events, still = [], []
        for inc, (_, reason), status in zip(self.transferring, local, agreed):
            if inc.req.aborted:
                events.append(self._end(scheduler, inc, FinishReason.ABORT, "the request was cancelled"))
            elif status == FAILED:
                reason = reason or "the transfer failed on another decode rank"
                logger.warning("decode request %d (room %d) failed: %s", inc.req.rid, inc.receiver.room, reason)
                events.append(self._end(scheduler, inc, FinishReason.ERROR, reason))
            elif status == DONE:
                events.append(self._start_decoding(scheduler, inc))
            else:
                still.append(inc)
        self.transferring = still
        return events

    def _start_decoding(self, scheduler: Scheduler, inc: Incoming) -> RequestEvent:
        req, result = inc.req, inc.receiver.result()
        assert result is not None
        scheduler.cache.complete(req.kv)
        transferred = req.prompt_len - inc.decode_prefix_len
        s = self.counters
        s.received_tokens += transferred
        s.transfers_ok += 1
        for tier, n in inc.by_tier.as_dict().items():
            s.decode_prefix_tokens[tier] += n
        event = scheduler.start_decoding(req, result.first_token, result.logprob)  # may finish it at once
        usage = DisaggUsage(inc.decode_prefix_len, inc.by_tier.as_dict(), transferred)
        return dataclasses.replace(event, cached_tokens_by_tier=dict(result.cached_tokens_by_tier), disagg=usage)

    def _end(self, scheduler: Scheduler, inc: Incoming, reason: FinishReason, message: str) -> RequestEvent:
        """Release a request that never started decoding, telling prefill why."""
        inc.receiver.abort(message)  # returns only once nothing more can land in its pages
        self.counters.transfers_failed += 1
        scheduler.cache.fail(inc.req.kv)
        return RequestEvent(inc.req.rid, (), finish_reason=reason, error=message)

    # ---- the end of a request -----------------------------------------------------------------

    def release(self, scheduler: Scheduler, req: Request, logprob: TokenLogprob | None) -> bool:
        """A decoding request's KV stays here: what it computed goes to this server's own cache."""
        return False

    def abort_all(self, scheduler: Scheduler, reason: FinishReason, message: str) -> list[RequestEvent]:
        events = [self._end(scheduler, inc, reason, message) for inc in self.incoming + self.transferring]
        self.incoming, self.transferring = [], []
        return events

    # ---- what the control commands see -----------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {"handshake": self.handshake.to_json()}

    def stats(self) -> DisaggStats:
        return dataclasses.replace(self.counters.snapshot(), received_bytes=self.transfer.moved_bytes)

    def close(self) -> None:
        self.transfer.shutdown()
