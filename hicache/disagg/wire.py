"""P/D disaggregation: the messages of the ZeroMQ transport, as multipart frames `[kind, JSON header,
*payload]` (a prefill ROUTER prefixes the peer's identity).

    decode -> prefill   HELLO {room: 0}                    which topology the prefill server has
                        META  {room, decode_prefix_len, prompt_len, prompt_digest, handshake,
                               word_every_s}               how often decode needs WORKING (its timeout / 4)
                        ACK   {room}                       this prefill rank's cells landed
                        ABORT {room, reason}               decode gave up on the request
    prefill -> decode   LAYOUT {room: 0, handshake}        the answer to HELLO
                        KV    {room, start, end[, pages]}, one frame per layer of the cells the pair
                              shares (cells.py): those cells of rows [start, end); a page-sharded rank
                              sends the rows of its own pages only and lists them (prompt page indices)
                        DONE  {room, end, first_token, logprob, cached_tokens_by_tier}
                        ERROR {room, reason}               prefill refused or failed the request
                        WORKING {room}                     prefill holds the request (queued or computing):
                                                           decode's wait for its KV counts from the last one
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from hicache.disagg.handshake import Handshake
from hicache.disagg.transfer import DecodeMetadata, PrefillResult
from hicache.scheduler.request import TokenLogprob
from hicache.storage import pack_u32

HELLO, META, ACK, ABORT = (b"hello", b"meta", b"ack", b"abort")
LAYOUT, KV, DONE, ERROR, WORKING = (b"layout", b"kv", b"done", b"error", b"working")
KINDS = (HELLO, META, ACK, ABORT, LAYOUT, KV, DONE, ERROR, WORKING)


class WireError(ValueError):
    """A message that is not one of ours (wrong kind, bad JSON, missing field)."""


def prompt_digest(prompt: Sequence[int]) -> str:
    """The prompt's ids as 4-byte little-endian ints, hashed: packed by numpy in one pass, not per token."""
    return hashlib.blake2b(pack_u32(prompt), digest_size=16).hexdigest()


def encode(kind: bytes, header: dict[str, Any]) -> list[bytes]:
    return [kind, json.dumps(header, separators=(",", ":")).encode()]


def decode(frames: Sequence[bytes | memoryview]) -> tuple[bytes, dict[str, Any], list[memoryview]]:
    """(kind, header, payload frames) of one message; WireError when it is not well formed."""
    if len(frames) < 2:
        raise WireError(f"a message of {len(frames)} frames")
    kind = bytes(frames[0])
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind[:16]!r}")
    try:
        header = json.loads(bytes(frames[1]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"bad header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("room"), int):
        raise WireError("a header without a room")
    return kind, header, [memoryview(f) for f in frames[2:]]


def metadata_header(meta: DecodeMetadata, word_every_s: float) -> dict[str, Any]:
    return {
        "room": meta.room,
        "decode_prefix_len": meta.decode_prefix_len,
        "prompt_len": meta.prompt_len,
        "prompt_digest": meta.prompt_digest,
        "handshake": meta.handshake.to_json(),
        "word_every_s": word_every_s,
    }


def word_every(header: dict[str, Any]) -> float:
    """How often the decode rank that sent this metadata needs to hear that its request is worked on."""
    try:
        every = float(header["word_every_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"bad metadata: {exc}") from None
    if not every > 0:
        raise WireError(f"bad metadata: word_every_s {every} is not positive")
    return every


def parse_metadata(header: dict[str, Any]) -> DecodeMetadata:
    try:
        return DecodeMetadata(
            room=int(header["room"]),
            decode_prefix_len=int(header["decode_prefix_len"]),
            prompt_len=int(header["prompt_len"]),
            prompt_digest=str(header["prompt_digest"]),
            handshake=Handshake.from_json(header["handshake"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"bad metadata: {exc}") from None


def result_header(room: int, end: int, result: PrefillResult) -> dict[str, Any]:
    lp = result.logprob
    return {
        "room": room,
        "end": end,
        "first_token": result.first_token,
        # JSON floats round-trip exactly (repr), and -Infinity is allowed, so logprobs arrive bit for bit.
        "logprob": None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]],
        "cached_tokens_by_tier": result.cached_tokens_by_tier,
    }


def parse_result(header: dict[str, Any]) -> PrefillResult:
    try:
        raw = header["logprob"]
        logprob = None
        if raw is not None:
            token_id, value, top = raw
            logprob = TokenLogprob(int(token_id), float(value), tuple((int(t), float(v)) for t, v in top))
        tiers = {str(k): int(v) for k, v in dict(header["cached_tokens_by_tier"]).items()}
        return PrefillResult(int(header["first_token"]), logprob, tiers)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"bad result: {exc}") from None
