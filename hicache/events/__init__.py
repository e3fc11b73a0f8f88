"""KV events (docs/DESIGN.md, "KV events"): what each server's cache stores and drops per tier, published
over ZeroMQ (`--kv-events-endpoint`), and a subscriber that keeps an index of it for a router."""

from hicache.events.index import BlockIndex, prompt_hashes
from hicache.events.publisher import KVEventPublisher
from hicache.events.subscriber import KVEventSubscriber
from hicache.events.wire import VERSION, Batch, decode_batch, snapshot_endpoint

__all__ = [
    "VERSION",
    "Batch",
    "BlockIndex",
    "KVEventPublisher",
    "KVEventSubscriber",
    "decode_batch",
    "prompt_hashes",
    "snapshot_endpoint",
]
