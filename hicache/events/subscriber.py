"""A KV events subscriber (docs/DESIGN.md, "KV events"): one server's pages per tier, kept from its events.

It applies batches in seq order. A batch that skips a seq (a message the PUB socket dropped, or one sent
before it connected) or comes from another epoch (the server restarted) means its index may be wrong:
it asks the server's snapshot socket for the pages held at some seq S, takes that as its index, and
applies only the batches after S. A router keeps one per server (hicache/router/cache_view.py); a stale
index costs it a worse choice of server, never a wrong answer (the server matches its own tree).
"""

from __future__ import annotations

import logging

import zmq

from hicache.events.index import BlockIndex
from hicache.events.wire import SNAPSHOT_REQUEST, TOPIC, decode_batch, decode_snapshot, snapshot_endpoint

logger = logging.getLogger(__name__)


class KVEventSubscriber:
    def __init__(self, endpoint: str, snapshot_timeout_s: float = 5.0) -> None:
        """Subscribes to the publisher at `endpoint` (its `--kv-events-endpoint`)."""
        self.endpoint = endpoint
        self.snapshot_endpoint = snapshot_endpoint(endpoint)
        self.snapshot_timeout_ms = int(snapshot_timeout_s * 1000)
        self.index = BlockIndex()
        self.epoch: str | None = None
        self.seq: int | None = None  # of the last batch applied (or of the snapshot): None before any
        self.resyncs = 0  # snapshots taken
        self.page_size: int | None = None
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.connect(endpoint)

    def receive(self, timeout_ms: int = 0) -> list[list[bytes]]:
        """The messages that arrived, waiting up to `timeout_ms` for the first (raw: `handle` applies them)."""
        messages = []
        if self._sub.poll(timeout_ms):
            while self._sub.poll(0):
                messages.append(self._sub.recv_multipart())
        return messages

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every message that arrived (waiting up to `timeout_ms` for the first); how many."""
        messages = self.receive(timeout_ms)
        for frames in messages:
            self.handle(frames)
        return len(messages)

    def handle(self, frames: list[bytes]) -> None:
        """Apply one batch, resynchronising first if it shows that something was missed. Raises
        ValueError for a message that is not a batch of this version (wire.py), changing nothing."""
        batch = decode_batch(frames)
        self.page_size = batch.page_size
        if self.seq is None or batch.epoch != self.epoch or batch.seq > self.seq + 1:
            self.resync()
            # The snapshot was taken after this batch was sent, so it covers this batch: S >= batch.seq.
        if batch.epoch != self.epoch or batch.seq <= self.seq:  # type: ignore[operator]
            return  # in the snapshot already (or from a publisher gone since)
        for event in batch.events:
            self.index.apply(event)
        self.seq = batch.seq

    def resync(self) -> None:
        """Replace the index by the publisher's snapshot. Raises TimeoutError if it does not answer."""
        with self._ctx.socket(zmq.DEALER) as req:
            req.setsockopt(zmq.LINGER, 0)
            req.connect(self.snapshot_endpoint)
            req.send_multipart([b"", SNAPSHOT_REQUEST])
            if not req.poll(self.snapshot_timeout_ms):
                raise TimeoutError(f"no KV events snapshot from {self.snapshot_endpoint}")
            self.epoch, self.seq, blocks = decode_snapshot(req.recv_multipart())
        self.index = BlockIndex.of(blocks)
        self.resyncs += 1
        logger.info("KV events from %s resynchronised at seq %d", self.endpoint, self.seq)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
