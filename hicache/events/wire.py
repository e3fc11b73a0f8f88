"""KV events on the wire (docs/DESIGN.md, "KV events"): the versioned message format, close to vLLM's.

A batch is one ZeroMQ multipart message on the PUB socket: [TOPIC, seq (8 bytes, big-endian), payload],
the payload UTF-8 JSON:

    {"version": 1, "epoch": "<publisher start id>", "seq": 7, "ts": 1733312345.5, "rank": 0,
     "page_size": 16, "events": [
        {"type": "BlockStored", "block_hashes": ["<hex>", ...], "parent_block_hash": "<hex>" | null,
         "token_count": 32, "medium": "device" | "host" | "storage"},
        {"type": "BlockRemoved", "block_hashes": ["<hex>", ...], "medium": "host"},
        {"type": "AllBlocksCleared", "media": ["device", "host"]}]}

Page hashes are the storage keys' chain (hicache/storage/keys.py: SHA-256 over the previous page's
digest and the page's token ids as 4-byte little-endian; a request's cache_salt seeds the chain), so a
router hashes a prompt itself and matches it. `seq` grows by one per batch from 1; a subscriber that
sees it skip (or `epoch` change: the server restarted) asks the snapshot socket (ROUTER, the PUB's port
+ 1) with one frame, SNAPSHOT_REQUEST, and gets [seq, payload] with the pages held at that seq:

    {"version": 1, "epoch": "...", "seq": 7, "rank": 0, "page_size": 16,
     "blocks": {"device": ["<hex>", ...], "host": [...], "storage": [...]}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from hicache.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from hicache.errors import UserError

VERSION = 1
TOPIC = b"kv-events"
SNAPSHOT_REQUEST = b"snapshot"


@dataclass(frozen=True)
class Batch:
    epoch: str
    seq: int
    ts: float
    rank: int
    page_size: int
    events: list[KVEvent]


def snapshot_endpoint(endpoint: str) -> str:
    """Where the snapshot socket of the publisher at `endpoint` (tcp://host:port) listens: port + 1."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise UserError(f"--kv-events-endpoint must be tcp://host:port, got {endpoint!r}")
    return f"tcp://{parts.netloc.rsplit(':', 1)[0]}:{parts.port + 1}"


def _event_json(event: KVEvent) -> dict:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash.hex() if event.parent_block_hash is not None else None
        return {"type": "BlockStored", "block_hashes": [h.hex() for h in event.block_hashes],
                "parent_block_hash": parent, "token_count": event.token_count, "medium": event.medium}  # fmt: skip
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [h.hex() for h in event.block_hashes], "medium": event.medium}
    return {"type": "AllBlocksCleared", "media": list(event.media)}


def _event_of(obj: dict) -> KVEvent:
    kind = obj["type"]
    if kind == "BlockStored":
        parent = obj["parent_block_hash"]
        hashes = tuple(bytes.fromhex(h) for h in obj["block_hashes"])
        return BlockStored(hashes, bytes.fromhex(parent) if parent else None, obj["token_count"], obj["medium"])
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(bytes.fromhex(h) for h in obj["block_hashes"]), obj["medium"])
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(tuple(obj["media"]))
    raise ValueError(f"unknown KV event type {kind!r}")


def encode_batch(batch: Batch) -> list[bytes]:
    payload = {"version": VERSION, "epoch": batch.epoch, "seq": batch.seq, "ts": batch.ts, "rank": batch.rank,
               "page_size": batch.page_size, "events": [_event_json(e) for e in batch.events]}  # fmt: skip
    return [TOPIC, batch.seq.to_bytes(8, "big"), json.dumps(payload, separators=(",", ":")).encode()]


def _payload(frame: bytes) -> dict:
    obj = json.loads(frame)
    if obj.get("version") != VERSION:
        raise ValueError(f"KV events version {obj.get('version')!r}, this reader speaks {VERSION}")
    return obj


def decode_batch(frames: list[bytes]) -> Batch:
    """Raises ValueError for a message that is not a batch of this version."""
    if len(frames) != 3 or frames[0] != TOPIC:
        raise ValueError("not a KV events batch")
    obj = _payload(frames[2])
    events = [_event_of(e) for e in obj["events"]]
    return Batch(obj["epoch"], obj["seq"], obj["ts"], obj["rank"], obj["page_size"], events)


def encode_snapshot(epoch: str, seq: int, rank: int, page_size: int, blocks: dict[str, list[bytes]]) -> list[bytes]:
    payload = {"version": VERSION, "epoch": epoch, "seq": seq, "rank": rank, "page_size": page_size,
               "blocks": {medium: [h.hex() for h in hashes] for medium, hashes in blocks.items()}}  # fmt: skip
    return [seq.to_bytes(8, "big"), json.dumps(payload, separators=(",", ":")).encode()]


def decode_snapshot(frames: list[bytes]) -> tuple[str, int, dict[str, list[bytes]]]:
    """(epoch, seq, pages by medium) of a snapshot reply."""
    obj = _payload(frames[-1])
    return obj["epoch"], obj["seq"], {m: [bytes.fromhex(h) for h in hs] for m, hs in obj["blocks"].items()}
