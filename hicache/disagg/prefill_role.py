"""P/D disaggregation: the prefill role, the part of the scheduler (hicache/scheduler/role.py) that serves
the prompt half of a request.

A request first waits, holding nothing, until its decode server's metadata has arrived on every rank,
from every decode rank the rank owes cells (cells.py; SGLang's bootstrap queue): decode admits the
request first, so prefill never computes for a decode that has no room for the result. The metadata is
validated here (the handshake matches this rank's, both servers tokenized the same prompt, 0 <=
decode_prefix_len <= prompt length and page-aligned); a request that fails it fails with the reason, and
decode is told. Then the request is admitted like any other (this server's own prefix cache decides how
much of the prompt it skips), its prompt and first token computed, and as it finishes the sender is
handed its KV after decode_prefix_len, still in its pages, with the first token. The request's result
is final then, but its pages stay locked (the scheduler's release stops at this role) while the
transport's thread reads them a chunk at a time; once every rank's transport has read them (or given
up), agreed like every other transfer outcome, every rank gives them back to the cache at the same
step (docs/DESIGN.md, "P/D streaming"). A request whose decode gives up meanwhile (its client left, its
transfer timed out) is aborted: nobody would receive what it computes. With a speculative draft the
draft's rows of the suffix travel with the target's (docs/DESIGN.md, "Speculation x P/D").
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from hicache.disagg.agreement import agree_min
from hicache.disagg.cells import misaligned
from hicache.disagg.handshake import Handshake
from hicache.disagg.kv_rows import PoolRows
from hicache.disagg.stats import DisaggStats
from hicache.disagg.transfer import DecodeMetadata, KVPoll, KVSender, KVTransferBackend, PrefillResult
from hicache.disagg.wire import prompt_digest
from hicache.mem.device_pool import DeviceKVPool
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.request import FinishReason, Request, RequestEvent, TokenLogprob
from hicache.scheduler.role import checked_intake
from hicache.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def metadata_problem(meta: DecodeMetadata, req: Request, mine: Handshake) -> str | None:
    """Why prefill refuses decode's metadata for `req` (None: it is valid)."""
    refused = mine.mismatch(meta.handshake) or misaligned(mine, meta.handshake)
    if refused is not None:
        return f"handshake refused: {refused}"
    if meta.prompt_len != req.prompt_len or meta.prompt_digest != prompt_digest(req.prompt_ids):
        return f"decode has another prompt ({meta.prompt_len} tokens) than prefill ({req.prompt_len} tokens)"
    d = meta.decode_prefix_len
    if not 0 <= d <= req.prompt_len or d % mine.page_size:
        return f"invalid decode_prefix_len {d}: it must be a multiple of {mine.page_size} in [0, {req.prompt_len}]"
    return None


class PrefillRole:
    """This rank's prefill role over its transfer backend; transfer outcomes are agreed over `pctx`."""

    def __init__(
        self, transfer: KVTransferBackend, pctx: ParallelContext, handshake: Handshake, bootstrap: tuple[str, int],
        draft: DeviceKVPool | None = None,
    ) -> None:  # fmt: skip
        self.transfer = transfer
        self.draft = draft  # a speculative draft's pool, whose rows each transfer moves after the target's
        self.pctx = pctx
        self.handshake = handshake
        self.bootstrap = bootstrap  # (host, base port): where decode servers reach this server's ranks
        self.counters = DisaggStats("prefill")
        self.bootstrapping: list[tuple[Request, KVSender]] = []  # waiting for decode's metadata
        self._senders: dict[int, KVSender] = {}  # rid -> sender, from bootstrap to release
        # Ended requests whose pages their transfer may still read, in release order (the same on
        # every rank): the scheduler gave them to this role instead of the cache.
        self.sending: list[tuple[Request, KVSender]] = []

    # ---- intake --------------------------------------------------------------------------------

    def add(self, scheduler: Scheduler, req: Request) -> None:
        if req.bootstrap is None:
            raise RuntimeError(f"request {req.rid} reached a prefill server without bootstrap information")
        req.max_new_tokens = 1  # prefill computes the prompt and the first token; decode does the rest
        scheduler.open(req)
        self.bootstrapping.append((req, self.transfer.sender(req.bootstrap, req.prompt_len)))

    def abort(self, rid: int) -> None:
        for req, _ in self.bootstrapping:
            if req.rid == rid:
                req.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.bootstrapping or self.sending)

    # ---- each step, before the batch -------------------------------------------------------------

    def _local_status(self, req: Request, sender: KVSender) -> tuple[int, str | None]:
        status = sender.poll()
        if status is KVPoll.FAILED:
            return KVPoll.FAILED, sender.failure()
        meta = sender.metadata()
        if meta is None:
            return KVPoll.BOOTSTRAPPING, None
        problem = metadata_problem(meta, req, self.handshake)
        return (KVPoll.FAILED, problem) if problem else (KVPoll.WAITING_FOR_INPUT, None)

    @checked_intake
    def intake(self, scheduler: Scheduler) -> list[RequestEvent]:
        """Give back the pages every rank's transport has read; move the requests whose metadata every
        rank has into the waiting queue; fail the refused; abort those being computed for a decode that
        has given up on them."""
        admitted = list(self._senders.items())  # in admission order, the same on every rank
        if not self.bootstrapping and not admitted and not self.sending:
            return []
        local = [self._local_status(req, sender) for req, sender in self.bootstrapping]
        for _, sender in admitted:
            sender.working()  # queued or computing: decode keeps waiting however long that takes
        wanted = [int(sender.poll() is not KVPoll.FAILED) for _, sender in admitted]
        read = [int(not sender.reading) for _, sender in self.sending]
        agreed = agree_min(self.pctx, [status for status, _ in local] + wanted + read)
        n_local, n_admitted = len(local), len(admitted)
        done = agreed[n_local + n_admitted :]
        for req, _ in [entry for entry, was_read in zip(self.sending, done) if was_read]:
            scheduler.release_kv(req)
        self.sending = [entry for entry, was_read in zip(self.sending, done) if not was_read]
        for (rid, _), still_wanted in zip(admitted, agreed[n_local : n_local + n_admitted]):
            if not still_wanted:
                scheduler.abort(rid)  # nobody will receive it: the step drops it
        events, still = [], []
        for (req, sender), (_, reason), status in zip(self.bootstrapping, local, agreed):
            if req.aborted:
                cancelled = "the request was cancelled on prefill"
                events.append(self._end(scheduler, req, sender, FinishReason.ABORT, cancelled))
            elif status == KVPoll.FAILED:
                reason = reason or "the transfer failed on another prefill rank"
                logger.warning("prefill request %d (room %d) failed: %s", req.rid, sender.room, reason)
                events.append(self._end(scheduler, req, sender, FinishReason.ERROR, reason))
            elif status == KVPoll.WAITING_FOR_INPUT:
                self._senders[req.rid] = sender
                scheduler.waiting.append(req)
            else:
                still.append((req, sender))
        self.bootstrapping = still
        return events

    def _end(
        self, scheduler: Scheduler, req: Request, sender: KVSender, reason: FinishReason, message: str
    ) -> RequestEvent:
        sender.abort(message)
        self.counters.transfers_failed += 1
        scheduler.cache.release(req.kv, req.tokens(req.kv.kv_len))
        return RequestEvent(req.rid, (), finish_reason=reason, error=message)

    # ---- the end of a request: send what decode needs --------------------------------------------

    def release(self, scheduler: Scheduler, req: Request, logprob: TokenLogprob | None) -> bool:
        """Every way a request ends passes here, its pages still held: finished with its first token
        (its only one, so `logprob` is the first token's), it sends, and keeps the pages until the
        transfer has read them (True); otherwise (aborted, failed) decode is told."""
        sender = self._senders.pop(req.rid, None)
        if sender is None:
            return False
        meta = sender.metadata()
        # The decoder computes a one-token request's draft rows in its prompt's step; never sent short.
        draft_short = self.draft is not None and req.kv.valid_len < req.prompt_len
        if req.output_ids and not req.aborted and meta is not None and not draft_short:
            kv = PoolRows(scheduler.runner.pool, req.kv.pages, meta.decode_prefix_len, req.prompt_len, self.draft)
            sender.send(kv, PrefillResult(req.output_ids[0], logprob, dict(req.kv.cached_tokens_by_tier)))
            self.counters.sent_tokens += kv.end - kv.start
            self.counters.transfers_ok += 1
            self.sending.append((req, sender))
            return True
        reason = "the prefill request was aborted before its KV was computed"
        if draft_short:
            reason = f"prefill's draft holds {req.kv.valid_len} of the prompt's {req.prompt_len} rows"
        sender.abort(reason)
        self.counters.transfers_failed += 1
        return False

    def abort_all(self, scheduler: Scheduler, reason: FinishReason, message: str) -> list[RequestEvent]:
        events = [self._end(scheduler, req, sender, reason, message) for req, sender in self.bootstrapping]
        self.bootstrapping = []
        for req, sender in self.sending:  # their results were final: only the transfer ends
            sender.abort(message)  # the transport reads at most the chunk it is on before it stops
            scheduler.release_kv(req)
        self.sending = []
        return events

    # ---- what the control commands see -----------------------------------------------------------

    def info(self) -> dict[str, Any]:
        host, port = self.bootstrap
        return {"bootstrap_host": host, "bootstrap_port": port, "handshake": self.handshake.to_json()}

    def stats(self) -> DisaggStats:
        return replace(
            self.counters.snapshot(),
            sent_bytes=self.transfer.moved_bytes,
            peak_staged_bytes=self.transfer.peak_staged_bytes,
        )

    def close(self) -> None:
        self.transfer.shutdown()
