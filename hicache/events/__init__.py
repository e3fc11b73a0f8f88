"""KV events (docs/DESIGN.md, "KV events"): what each server's cache stores and drops per tier, published
over ZeroMQ (`--kv-events-endpoint`) in vLLM's format, and a subscriber that keeps an index of any
server's events (hicache's or vLLM's) for a router."""

from hicache.events.index import BlockIndex, prompt_hashes
from hicache.events.publisher import KVEventPublisher
from hicache.events.subscriber import KVEventSubscriber
from hicache.events.wire import KVEventBatch, decode_batch, replay_endpoint

__all__ = [
    "BlockIndex",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventSubscriber",
    "decode_batch",
    "prompt_hashes",
    "replay_endpoint",
]
