"""KV events on the wire (docs/DESIGN.md, "KV events"): vLLM's format, so what reads a vLLM server's events
(NVIDIA Dynamo's and llm-d's KV routers, SGLang's gateway, vLLM's own subscriber) reads hicache's, and
`hicache router` reads a vLLM server's.

A batch is one ZeroMQ multipart message on the PUB socket: [topic, seq (8 bytes, big-endian), payload],
the payload vLLM's `KVEventBatch` in msgpack: an array [ts, events, data_parallel_rank], each event a map
tagged by its "type":

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ... | None, "token_ids": [...],
     "block_size": 16, "lora_id": None, "medium": "GPU" | "CPU" | "STORAGE", "lora_name": None,
     "extra_keys": [("<cache_salt>",), None, ...]}          (extra_keys only for a salted chain's start)
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "CPU"}
    {"type": "AllBlocksCleared"}

The media are vLLM's names for hicache's tiers (MEDIUM_OF). vLLM before its map-shaped events sent each
event as an array [type, fields in order]; `decode_batch` reads both, and fields it does not know, so a
subscriber reads any vLLM of the last year. A replay request (vLLM's) is [b"", start seq (8 bytes)] from a
DEALER to the publisher's ROUTER; the answer is [b"", topic, seq, payload] per batch from that seq on,
then [b"", b"", END_SEQ, b""] (vLLM 0.32's; older releases sent no topic frame, which a reader takes too).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import msgspec

from hicache.cache import MEDIA, KVEvent
from hicache.cache import BlockRemoved as RecordedRemoved
from hicache.cache import BlockStored as RecordedStored
from hicache.errors import UserError

DEVICE, HOST, STORAGE = MEDIA  # the cache's tiers, fastest first
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame, as vLLM ends it
MEDIUM_OF = {DEVICE: "GPU", HOST: "CPU", STORAGE: "STORAGE"}  # vLLM's media: MEDIUM_GPU, MEDIUM_CPU, ...
BlockHash = bytes | int  # vLLM's ExternalBlockHash: hicache's are 32-byte digests


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's BlockStored, its fields in its order (those without a default are required by its decoder)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_FIELDS = {cls.__name__: cls.__struct_fields__ for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


def replay_endpoint(endpoint: str) -> str:
    """Where the replay socket of the publisher at `endpoint` (tcp://host:port) listens: port + 1."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise UserError(f"--kv-events-endpoint must be tcp://host:port, got {endpoint!r}")
    return f"tcp://{parts.netloc.rsplit(':', 1)[0]}:{parts.port + 1}"


def tier_of(medium: str | None) -> str:
    """hicache's tier for a vLLM medium: GPU (or none, as vLLM sent before it named media) the device,
    CPU the host, any other (STORAGE, a disk or remote tier of an offloading connector) storage."""
    return {None: DEVICE, "GPU": DEVICE, "CPU": HOST}.get(medium, STORAGE)


def salt_of(stored: BlockStored) -> str:
    """The cache_salt of a chain `stored` starts (parent None): vLLM puts it in the first block's
    extra_keys, the string that is not the LoRA name (the others are tuples or bytes)."""
    keys = (stored.extra_keys or [None])[0] or ()
    return next((k for k in keys if isinstance(k, str) and k != stored.lora_name), "")


def wire_events(event: KVEvent, page_size: int, held: dict[str, set[BlockHash]]) -> list[WireEvent]:
    """A recorded event (hicache/cache/kv_events.py) as vLLM's events; `held`: the pages on each tier
    before it. A flush clears the device and host tiers but not storage, which vLLM's AllBlocksCleared
    (every medium) cannot say: the pages those tiers held are removed instead."""
    if isinstance(event, RecordedStored):
        salt = event.cache_salt
        extra = [(salt,)] + [None] * (len(event.block_hashes) - 1) if salt else None
        hashes, tokens = list(event.block_hashes), event.token_ids.tolist()
        medium = MEDIUM_OF[event.medium]
        return [BlockStored(hashes, event.parent_block_hash, tokens, page_size, None, medium, None, extra)]
    if isinstance(event, RecordedRemoved):
        return [BlockRemoved(list(event.block_hashes), MEDIUM_OF[event.medium])]
    if set(event.media) == set(MEDIA):
        return [AllBlocksCleared()]
    gone = [(tier, list(held[tier])) for tier in event.media]
    return [BlockRemoved(pages, MEDIUM_OF[tier]) for tier, pages in gone if pages]


def encode_payload(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def _event(raw: Any) -> WireEvent:
    if isinstance(raw, list | tuple):  # vLLM's array-shaped events: [type, fields in order]
        kind, values = raw[0], raw[1:]
        raw = {"type": kind, **dict(zip(_FIELDS.get(kind, ()), values, strict=False))}
    if not isinstance(raw, dict):
        raise TypeError(f"a KV event is a map or an array, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "BlockStored":
        return BlockStored(
            list(raw["block_hashes"]),
            raw.get("parent_block_hash"),
            list(raw["token_ids"]),
            int(raw["block_size"]),
            raw.get("lora_id"),
            raw.get("medium"),
            raw.get("lora_name"),
            [tuple(k) if k is not None else None for k in raw["extra_keys"]] if raw.get("extra_keys") else None,
        )
    if kind == "BlockRemoved":
        return BlockRemoved(list(raw["block_hashes"]), raw.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def decode_payload(payload: bytes) -> KVEventBatch:
    """A batch as any vLLM (or hicache) sends it. Raises ValueError for anything else."""
    try:
        raw = msgspec.msgpack.decode(payload)
        if isinstance(raw, dict):
            raw = [raw["ts"], raw["events"], raw.get("data_parallel_rank")]
        ts, events, *rank = raw
        return KVEventBatch(float(ts), [_event(e) for e in events], rank[0] if rank else None)
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a KV events batch: {exc}") from None


def decode_batch(frames: list[bytes]) -> tuple[int, KVEventBatch]:
    """(seq, batch) of a PUB message [topic, seq, payload]. Raises ValueError for anything else."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError("not a KV events message: [topic, seq (8 bytes), payload]")
    return int.from_bytes(frames[1], "big"), decode_payload(frames[2])
