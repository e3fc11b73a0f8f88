"""P/D disaggregation: the KV transfer interface, shaped like SGLang's `BaseKVSender` / `BaseKVReceiver`
so that an RDMA engine (Mooncake, NIXL) could stand behind it on GPU clusters; ZeroMQ over TCP
(zmq_prefill.py, zmq_decode.py) is the one built in.

One `KVTransferBackend` per rank process (SGLang's KVManager) makes one sender (prefill) or receiver
(decode) per request, named by the request's bootstrap room. The life of a transfer:

    decode                                              prefill
    receiver.init(slots, metadata) ── metadata ──▶      sender.poll(): BOOTSTRAPPING → WAITING_FOR_INPUT
      (send_metadata: decode_prefix_len, handshake)     (the request is admitted and prefilled)
                                   ◀── KV pages ──      sender.send(its rows after decode_prefix_len,
                                   (chunk by chunk)                 first token); sender.reading
    receiver.poll(): TRANSFERRING → SUCCESS  ◀─ done ─    (pages stay locked until it is False)
    receiver.result(): the first token            ── ack ──▶  sender.poll(): SUCCESS

Either side's `abort(reason)` tells the other; a peer that goes away, a refused handshake or a timeout
makes `poll()` FAILED with `failure()` saying why. Every call is made on the scheduler thread;
implementations move bytes on threads of their own. A receiver writes arriving pages straight into the
reserved device pages; after `abort` returns it writes nothing more, so the pages may be freed.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
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


class KVSource(Protocol):
    """This rank's KV rows of tokens [start, end), still in the request's device pages: the transport
    reads them a chunk at a time (kv_rows.PoolRows), so its host memory holds chunks, not the suffix."""

    start: int
    end: int

    def held(self, start: int, end: int) -> list[int] | None:
        """The pages of tokens [start, end) this rank holds, of a page-sharded pool (None: every page)."""

    def read(self, start: int, end: int, layers: Collection[int] | None = None) -> dict[int, torch.Tensor]:
        """A host copy of the rows of tokens [start, end) (absolute token positions) this rank holds, a
        tensor per local layer of `layers` (all by default)."""


class KVSender(Protocol):
    """Prefill side of one request's transfer."""

    room: int

    def poll(self) -> KVPoll: ...

    def metadata(self) -> DecodeMetadata | None:
        """Decode's metadata, once it arrived (poll() >= WAITING_FOR_INPUT)."""

    def working(self) -> None:
        """Tell decode the request is still held here, queued or computing (the transport may say it less
        often than it is called): decode waits for the KV from prefill's last word, not from its metadata,
        so a prompt that computes for longer than the transfer timeout does not time out."""

    def send(self, kv: KVSource, result: PrefillResult) -> None:
        """Send the KV after decode_prefix_len and the first token (returns at once; the transport
        reads `kv` on its own thread while `reading`)."""

    @property
    def reading(self) -> bool:
        """Whether the transport may still read the source handed to `send`: until it is False on
        every rank, the pages under it must stay the request's."""

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

    @property
    def peak_staged_bytes(self) -> int:
        """The most KV bytes this rank held in host memory at once on their way out (prefill; 0 on
        decode, which lands each message in the pool as it arrives)."""

    def shutdown(self) -> None:
        """Fail what is in flight, stop the threads, close the endpoint."""
