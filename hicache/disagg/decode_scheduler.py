"""P/D disaggregation: the decode role's scheduler.

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

import torch

from hicache.cache.api import PrefixMatch, RestoreState
from hicache.disagg.agreement import agree_min
from hicache.disagg.role_scheduler import RoleScheduler
from hicache.disagg.transfer import DecodeMetadata, KVPoll, KVReceiver
from hicache.disagg.wire import prompt_digest
from hicache.engine.request import DisaggUsage, FinishReason, Request, RequestEvent

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
        """Tokens decode serves from its tree (page-aligned); prefill sends the KV after them."""
        return self.by_tier.total


class DecodeScheduler(RoleScheduler):
    role = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.incoming: list[Incoming] = []  # waiting for decode-side admission, in arrival order
        self.transferring: list[Incoming] = []  # RESERVED: the suffix arriving, the host part restoring

    # ---- intake --------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.bootstrap is None:
            raise RuntimeError(f"request {req.rid} reached a decode server without bootstrap information")
        req.kv_handle = self.cache.open(req.rid, req.prompt_ids, req.namespace)
        self.incoming.append(Incoming(req, self.transfer.receiver(req.bootstrap)))

    def abort(self, rid: int) -> None:
        super().abort(rid)
        for inc in self.incoming + self.transferring:
            if inc.req.rid == rid:
                inc.req.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.incoming or self.transferring) or super().has_work

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestEvent]:
        return self._admit_incoming() + self._land() + super().step()

    def _admit_incoming(self) -> list[RequestEvent]:
        events = [
            self._end(inc, FinishReason.ABORT, "the request was cancelled") for inc in self.incoming if inc.req.aborted
        ]
        self.incoming = [inc for inc in self.incoming if not inc.req.aborted]
        busy = bool(self.running or self.transferring)
        for inc in list(self.incoming):
            req = inc.req
            if len(self.running) + len(self.transferring) >= self.cfg.max_running_requests:
                break
            if not self.cache.ready_to_admit(req.kv, busy=busy):
                continue  # its storage prefetch is still running; later arrivals may go first
            total = self._pages_for(req.prompt_len + req.max_new_tokens)
            if not self.cache.reserve(req.kv, total).admitted:
                break  # first come, first served: no overtaking on memory
            self.incoming.remove(inc)
            d = inc.decode_prefix_len
            slots = self.runner.pool.allocator.slots(req.kv.pages, req.prompt_len)[d:].to(self.runner.pool.device)
            room = inc.receiver.room
            inc.receiver.init(
                slots, DecodeMetadata(room, d, req.prompt_len, prompt_digest(req.prompt_ids), self.handshake)
            )
            self.transferring.append(inc)
        return events

    def _local_status(self, inc: Incoming) -> tuple[int, str | None]:
        status = inc.receiver.poll()
        if status is KVPoll.FAILED:
            return FAILED, inc.receiver.failure()
        restore = self.cache.restore_status(inc.req.kv)
        if restore.state is RestoreState.FAILED:
            return FAILED, (
                f"decode could not restore the {inc.by_tier.host + inc.by_tier.storage}-token host part of the "
                f"prefix it promised prefill: {restore.error}"
            )
        return (DONE if status is KVPoll.SUCCESS and restore.state is RestoreState.LANDED else PENDING), None

    def _land(self) -> list[RequestEvent]:
        """Requests whose suffix and restore are done on every rank start decoding; failed ones end."""
        if not self.transferring:
            return []
        local = [self._local_status(inc) for inc in self.transferring]
        prefixes = [inc.decode_prefix_len for inc in self.transferring]
        agreed = agree_min(self.pctx, [status for status, _ in local], equal=prefixes)
        events, still = [], []
        for inc, (_, reason), status in zip(self.transferring, local, agreed):
            if inc.req.aborted:
                events.append(self._end(inc, FinishReason.ABORT, "the request was cancelled"))
            elif status == FAILED:
                reason = reason or "the transfer failed on another decode rank"
                logger.warning("decode request %d (room %d) failed: %s", inc.req.rid, inc.receiver.room, reason)
                events.append(self._end(inc, FinishReason.ERROR, reason))
            elif status == DONE:
                events.append(self._start_decoding(inc))
            else:
                still.append(inc)
        self.transferring = still
        return events

    def _start_decoding(self, inc: Incoming) -> RequestEvent:
        req, result = inc.req, inc.receiver.result()
        assert result is not None
        self.cache.complete(req.kv)
        transferred = req.prompt_len - inc.decode_prefix_len
        s = self.stats
        s.received_tokens += transferred
        s.transfers_ok += 1
        for tier, n in inc.by_tier.as_dict().items():
            s.decode_prefix_tokens[tier] += n
        if req.params.seed is not None and req.generator is None:
            req.generator = torch.Generator().manual_seed(req.params.seed)
        self.running.append(req)
        event = self._append_token(req, result.first_token, result.logprob)  # may finish it at once
        usage = DisaggUsage(inc.decode_prefix_len, inc.by_tier.as_dict(), transferred)
        return dataclasses.replace(event, cached_tokens_by_tier=dict(result.cached_tokens_by_tier), disagg=usage)

    def _end(self, inc: Incoming, reason: FinishReason, message: str) -> RequestEvent:
        """Release a request that never started decoding, telling prefill why."""
        inc.receiver.abort(message)  # returns only once nothing more can land in its pages
        self.stats.transfers_failed += 1
        self.cache.fail(inc.req.kv)
        return RequestEvent(inc.req.rid, (), finish_reason=reason, error=message)

    def abort_all(self, reason: FinishReason, message: str) -> list[RequestEvent]:
        events = [self._end(inc, reason, message) for inc in self.incoming + self.transferring]
        self.incoming, self.transferring = [], []
        return events + super().abort_all(reason, message)
