"""A KV events subscriber (docs/DESIGN.md, "KV events"): one server's pages per tier, kept from its events,
hicache's or vLLM's (wire.py).

It applies batches in seq order. A batch that skips a seq (a message the PUB socket dropped, one sent
before it connected, or a restarted hicache server, whose seqs start above its last life's) means its
index may be wrong: it asks the server's replay socket (vLLM's protocol, at the PUB's port + 1) for the
batches from the first it lacks; a hicache server answers from further back than its buffer with its
state. A batch behind the last applied is one a replay covered, unless it is stamped later than any
applied: a restarted vLLM server counting from 0 again, which empties the index and replays from 0.
A router keeps one per server (hicache/router/cache_view.py); a stale index costs it a worse choice of
server, never a wrong answer (the server matches its own tree).
"""

from __future__ import annotations

import logging

import zmq

from hicache.events.index import BlockIndex
from hicache.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    KVEventBatch,
    decode_batch,
    decode_payload,
    replay_endpoint,
)

logger = logging.getLogger(__name__)


class KVEventSubscriber:
    def __init__(self, endpoint: str, replay_timeout_s: float = 5.0) -> None:
        """Subscribes to the publisher at `endpoint` (its `--kv-events-endpoint`), every topic."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint(endpoint)
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.index = BlockIndex()
        self.seq: int | None = None  # of the last batch applied: None before any
        self.ts = 0.0  # the newest stamp of a batch applied
        self.replays = 0  # replays asked for
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
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
        """Apply one batch, catching up first if it shows that something was missed. Raises ValueError
        for a message that is not a batch (wire.py), changing nothing."""
        seq, batch = decode_batch(frames)
        if self.seq is not None and seq <= self.seq:
            # Behind: a batch a replay already covered (sent before it, so no later than the newest batch
            # applied: a publisher stamps its batches in order), or a restarted vLLM counting from 0 again.
            if batch.ts <= self.ts:
                return
            self._try_catch_up(restarted=True)
        elif self.seq is None or seq != self.seq + 1:
            self._try_catch_up()
        # A replay is answered after this batch was sent, so it covers it: then self.seq >= seq.
        if self.seq is None or seq > self.seq:
            self._apply(seq, batch)

    def _try_catch_up(self, restarted: bool = False) -> None:
        """`catch_up`, or, where the replay does not come (a vLLM server started without a
        replay_endpoint), go on from this batch: what live batches say is still worth knowing, and the
        next gap asks again."""
        try:
            self.catch_up(restarted)
        except TimeoutError as exc:
            logger.warning("KV events from %s: %s; following the live batches from here", self.endpoint, exc)

    def catch_up(self, restarted: bool = False) -> None:
        """Ask the publisher for what this index lacks (`restarted`: all it holds) and apply it. Raises
        TimeoutError if it does not answer."""
        if restarted:
            self.index, self.seq, self.ts = BlockIndex(), None, 0.0
        start = 0 if self.seq is None else self.seq + 1
        with self._ctx.socket(zmq.DEALER) as req:
            req.setsockopt(zmq.LINGER, 0)
            req.connect(self.replay_endpoint)
            req.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not req.poll(self.replay_timeout_ms):
                    raise TimeoutError(f"no KV events replay from {self.replay_endpoint}")
                *_, seq_bytes, payload = req.recv_multipart()  # vLLM puts the topic before the seq since 0.2x
                if seq_bytes == END_SEQ:
                    break
                seq, batch = int.from_bytes(seq_bytes, "big"), decode_payload(payload)
                # A batch already applied is skipped; a state (it clears first) never is: a publisher
                # whose clock went back across a restart numbers it below what this index saw.
                if self.seq is None or seq > self.seq or batch.events[:1] == [AllBlocksCleared()]:
                    self._apply(seq, batch)
        self.replays += 1
        logger.info("KV events from %s replayed up to seq %s", self.endpoint, self.seq)

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        for event in batch.events:
            self.index.apply(event)
        self.seq, self.ts = seq, max(self.ts, batch.ts)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
