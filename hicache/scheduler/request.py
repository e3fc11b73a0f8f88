"""Requests as the scheduler sees them, their sampling parameters, and the events they emit.

A request's KV state (pages, lock, reservation, computed length, hits by tier) is not here: it is the
cache's `KVHandle` (hicache/cache/api.py), which the scheduler opens when the request arrives and
attaches (`req.kv`). The request keeps the reference, rather than the scheduler a rid -> handle map,
so the handle lives and dies with the request on every path (waiting, running, aborted) with nothing
to keep in step.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

import torch

from hicache.cache import NO_RETENTION, KVHandle, Retention
from hicache.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int | None = None  # None: the engine's default
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to report per generated token

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < 1e-5:
            # Dividing logits by a vanishing temperature overflows; it means greedy anyway.
            object.__setattr__(self, "temperature", 0.0)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise UserError(f"seed must be in [0, 2**63), got {self.seed}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise UserError(f"logprobs must be between 0 and 20, got {self.logprobs}")


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TIMEOUT = "timeout"  # --request-timeout passed; everything it held was released


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Bootstrap:
    """Where the two halves of a prefill-decode request meet (hicache/disagg/): the prefill server's KV
    transfer endpoint (rank r at port + r) and the room both servers name the request by. `hicache
    router` sets it on both copies of the request."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class DisaggUsage:
    """A decode server's account of one request's KV: the page-aligned prefix it served from its own
    tree (by tier) and the prompt tokens whose KV came from prefill."""

    decode_prefix_tokens: int
    decode_prefix_by_tier: dict[str, int]
    transferred_tokens: int


@dataclass(frozen=True)
class RequestEvent:
    """New output of one request in one step; the last event of a request has `finish_reason` set."""

    rid: int
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None  # set on the first event
    error: str | None = None
    spec_tokens: tuple[int, int] | None = None  # (proposed, accepted) draft tokens: last event, speculative only
    disagg: DisaggUsage | None = None  # first event of a P/D decode request


_rids = itertools.count(1)


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    namespace: str = ""
    rid: int = field(default_factory=lambda: next(_rids))
    output_ids: list[int] = field(default_factory=list)
    kv_handle: KVHandle | None = None  # opened by the scheduler when the request arrives
    aborted: bool = False
    generator: torch.Generator | None = None
    first_event_sent: bool = False
    prompt_shared: bool = False  # its prompt's pages are in the tree
    spec_proposed: int = 0  # draft tokens proposed for it (speculative decoding) ...
    spec_accepted: int = 0  # ... and accepted by the target's verification
    bootstrap: Bootstrap | None = None  # a prefill-decode request's meeting point
    retention: Retention = NO_RETENTION  # its cache retention hint, stamped with its arrival by the engine

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def kv(self) -> KVHandle:
        """The KV handle (a request is in the scheduler's queues only with one)."""
        assert self.kv_handle is not None, f"request {self.rid} has no KV handle"
        return self.kv_handle

    @property
    def cached_tokens(self) -> int:
        return self.kv.cached.total

    def token(self, index: int) -> int:
        return self.prompt_ids[index] if index < self.prompt_len else self.output_ids[index - self.prompt_len]

    def tokens(self, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[:end]

    @property
    def in_prefill(self) -> bool:
        return self.kv.kv_len < self.prompt_len
