"""P/D disaggregation: the KV transfer interface, shaped like SGLang's `BaseKVSender` / `BaseKVReceiver`
so that an RDMA engine (Mooncake, NIXL) could stand behind it on GPU clusters; ZeroMQ over TCP
(zmq_prefill.py, zmq_decode.py) is the one built in.

One `KVTransferBackend` per rank process (SGLang's KVManager) makes one sender (prefill) or receiver
(decode) per request, named by the request's bootstrap room. The life of a transfer:

    decode                                              prefill
    receiver.init(slots, metadata) ── metadata ──▶      sender.poll(): BOOTSTRAPPING → WAITING_FOR_INPUT
      (send_metadata: decode_prefix_len, handshake)     (the request is admitted and prefilled)
                                   ◀── KV pages ──      sender.send(staged KV after decode_prefix_len,
    receiver.poll(): TRANSFERRING → SUCCESS  ◀─ done ─                  first token)
    receiver.result(): the first token            ── ack ──▶  sender.poll(): SUCCESS

Either side's `abort(reason)` tells the other; a peer that goes away, a refused handshake or a timeout
makes `poll()` FAILED with `failure()` saying why. Every call is made on the scheduler thread;
implementations move bytes on threads of their own. A receiver writes arriving pages straight into the
reserved device pages; after `abort` returns it writes nothing more, so the pages may be freed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from hicache.disagg.handshake import Handshake
from hicache.scheduler.request import Bootstrap, TokenLogprob


class KVPoll(enum.IntEnum):
    """SGLang's KVPoll states, in order of progress (FAILED is lowest, so a MIN across ranks fails
    if any rank failed and succeeds only if every rank did)."""

    FAILED = 0
    BOOTSTRAPPING = 1  # sender: waiting for decode's metadata; receiver: metadata not yet sent
    WAITING_FOR_INPUT = 2  # sender: metadata in, KV not computed yet; receiver: metadata sent
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass(frozen=True)
class DecodeMetadata:
    """What decode tells prefill about one request (SGLang's `send_metadata`)."""

    room: int
    decode_prefix_len: int  # page-aligned; prefill sends the KV of tokens [decode_prefix_len, prompt_len)
    prompt_len: int
    prompt_digest: str  # both servers must have tokenized the same prompt
    handshake: Handshake


@dataclass(frozen=True)
class PrefillResult:
    """What prefill hands decode besides the KV (SGLang's auxiliary data): the first output token, its
    log-probabilities when asked for, and how much of the prompt prefill's own cache served."""

    first_token: int
    logprob: TokenLogprob | None
    cached_tokens_by_tier: dict[str, int]


@dataclass(frozen=True)
class StagedKV:
    """This rank's KV rows of tokens [start, end), one [end - start, row] tensor per local layer, copied
    out of the device pool (so the request's pages can be released while the bytes travel)."""

    start: int
    end: int
    layers: list[torch.Tensor]


class KVSender(Protocol):
    """Prefill side of one request's transfer."""

    room: int

    def poll(self) -> KVPoll: ...

    def metadata(self) -> DecodeMetadata | None:
        """Decode's metadata, once it arrived (poll() >= WAITING_FOR_INPUT)."""

    def send(self, kv: StagedKV, result: PrefillResult) -> None:
        """Send the KV after decode_prefix_len and the first token (returns at once)."""

    def abort(self, reason: str) -> None:
        """Give up; decode is told `reason`. Idempotent."""

    def failure(self) -> str | None: ...


class KVReceiver(Protocol):
    """Decode side of one request's transfer."""

    room: int

    def init(self, slots: torch.Tensor, metadata: DecodeMetadata) -> None:
        """Send `metadata` to prefill and take the KV of tokens [decode_prefix_len, prompt_len) into the
        device pool at `slots` (one per token, reserved for this request)."""

    def poll(self) -> KVPoll: ...

    def result(self) -> PrefillResult | None:
        """Prefill's first token, once poll() is SUCCESS."""

    def abort(self, reason: str) -> None:
        """Give up; prefill is told `reason`; no byte lands in the slots after this returns. Idempotent."""

    def failure(self) -> str | None: ...


class KVTransferBackend(Protocol):
    """One rank's transport (SGLang's KVManager): its endpoint, its threads, its per-request parts."""

    def sender(self, bootstrap: Bootstrap, prompt_len: int) -> KVSender:
        """Prefill: the sender of the request named by `bootstrap.room`."""

    def receiver(self, bootstrap: Bootstrap) -> KVReceiver:
        """Decode: the receiver of that request, from the prefill rank at bootstrap.host:port + rank."""

    @property
    def moved_bytes(self) -> int:
        """KV bytes this rank has sent (prefill) or landed (decode) so far, as they move."""

    def shutdown(self) -> None:
        """Fail what is in flight, stop the threads, close the endpoint."""
