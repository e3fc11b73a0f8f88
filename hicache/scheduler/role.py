"""The scheduler's role part (docs/DESIGN.md, "scheduler"): where a request comes from before this scheduler
schedules it, and where its result goes once it ends, where that is not the plain way (a request waits
in the scheduler's queue from `add`, streams its tokens to its client, and ends in the cache's release).

A P/D role (hicache/disagg/roles.py) is such a part: the prefill role holds a request until its decode
server has room for it and sends its KV when it ends; the decode role reserves a request's pages and
lands its KV from prefill before it joins the running batch. Shaped after the scheduler side of vLLM's
KVConnector: the scheduler calls the role at a few fixed points and knows nothing of transports, so a
role is combined with the other parts (the model step, plain or speculative: `StepCompute`) by
configuration alone; a combination that is not supported yet is refused at start-up, not by the code.

The scheduler calls (hicache/scheduler/scheduler.py):

- `add(scheduler, req)` for every new request, in place of putting it in the waiting queue: the role
  opens its KV handle when it takes it, and puts it into `scheduler.waiting` (to be admitted and
  computed here) or `scheduler.start_decoding` (its prompt's KV written from outside) in a later
  `intake`.
- `intake(scheduler)` first in every step, on every rank, before the batch is built; it returns the
  events of the requests it ended (refused, failed, aborted) or started. Whatever it decides from
  asynchronous results (a transfer's progress) it agrees on across ranks first (SPMD), and its
  decisions are the consensus checker's to compare (`checked_intake`).
- `release(scheduler, req, logprob)` on every end of a request this scheduler ran or queued (finished,
  aborted, failed), its pages still held, before the cache takes them back; `logprob` is that of the
  token it finished on (None when it ended otherwise). It returns True when the role keeps the pages
  (the prefill role, until its transfer has read them) and gives them back itself later, at the same
  step on every rank, through `scheduler.release_kv(req)`.
- `abort(rid)`, `has_work`, `abort_all(scheduler, reason, message)` for the requests the role holds
  itself; `info()`, `stats()` for the control commands (hicache/engine/commands.py); `close()` when
  the scheduler stops.

A role reaches the scheduler only through what the calls pass: its `cache`, `runner.pool`, `cfg`,
`waiting`, `running`, `open`, `pages_needed`, `start_decoding`, `abort` and `release_kv`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol

from hicache.debug.consensus_checker import consensus_checked
from hicache.scheduler.request import FinishReason, Request, RequestEvent, TokenLogprob

if TYPE_CHECKING:
    from hicache.scheduler.scheduler import Scheduler


def _ended_or_started(namespace: Mapping[str, Any]) -> list[tuple[int, FinishReason | None, tuple[int, ...]]]:
    return [(e.rid, e.finish_reason, e.new_token_ids) for e in namespace["result"]]


def _queues(namespace: Mapping[str, Any]) -> dict[str, list[int]]:
    scheduler = namespace["scheduler"]
    return {"waiting": [r.rid for r in scheduler.waiting], "running": [r.rid for r in scheduler.running]}


# The mark of every role's `intake` (hicache/debug/consensus_checker.py): what it ended or started, and
# the scheduler's queues after it, must be the same on every rank before the batch is built from them.
checked_intake = consensus_checked(results={"events": _ended_or_started, "queues": _queues})


class Role(Protocol):
    def add(self, scheduler: Scheduler, req: Request) -> None:
        """Take a new request (raise if it cannot be served in this role, before opening its handle)."""

    def intake(self, scheduler: Scheduler) -> list[RequestEvent]:
        """Move the requests that may go on into the scheduler's queues; end those that cannot."""

    def release(self, scheduler: Scheduler, req: Request, logprob: TokenLogprob | None) -> bool:
        """A request of the scheduler's ends, its pages still held: hand on what it computed. True: the
        role keeps the pages and hands them to `scheduler.release_kv` itself (`has_work` meanwhile)."""

    def abort(self, rid: int) -> None:
        """The client went away: mark the request if the role holds it (the next `intake` ends it)."""

    @property
    def has_work(self) -> bool:
        """The role holds requests that a later `intake` moves on."""

    def abort_all(self, scheduler: Scheduler, reason: FinishReason, message: str) -> list[RequestEvent]:
        """End every request the role holds now, giving back what each holds."""

    def info(self) -> dict[str, Any]:
        """What the role shows of itself (the `disagg_info` command)."""

    def stats(self) -> Any:
        """The role's counters (the `disagg_stats` command)."""

    def close(self) -> None:
        """Stop what the role started (a transfer endpoint)."""
