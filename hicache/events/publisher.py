"""The KV events publisher (docs/DESIGN.md, "KV events"): one per server, on rank 0 (every rank of the
tree-sharing group keeps the same tree, so rank 0 speaks for them), behind `--kv-events-endpoint`.

The scheduler thread calls `publish` after every step: it drains the cache's recorder (what the step
stored and dropped) and hands the events to the publisher's thread, which puts them in vLLM's format
(wire.py), numbers the batch, applies it to its own `BlockIndex`, sends it on the PUB socket and keeps
it for replay. The same thread answers replay requests on a ROUTER socket at port + 1, as vLLM's
publisher does: the batches from the asked seq on, from its buffer; a request from further back than
the buffer (a subscriber that joined late, or saw a restart) gets one batch that is the state itself
(`BlockIndex.state_events`), numbered as the last batch sent. Sequence numbers start at the clock's
nanoseconds, not at 0: a restarted server's are higher than any its subscribers saw, which they read
as a gap, and a gap from before this server's buffer is answered with its state. ZeroMQ sockets are
not thread-safe, so both live on that one thread, and a slow subscriber never holds up a step (PUB
drops for it; it then asks for a replay).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from hicache.cache import KVEventRecorder
from hicache.errors import UserError
from hicache.events.index import BlockIndex
from hicache.events.wire import END_SEQ, KVEventBatch, encode_payload, replay_endpoint, wire_events

logger = logging.getLogger(__name__)

POLL_MS = 20  # the longest a batch waits on the publisher thread before it is sent
BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default); from further back, the state
TOPIC = b"kv-events"  # the topic vLLM's and SGLang's examples publish on


class KVEventPublisher:
    def __init__(self, endpoint: str, recorder: KVEventRecorder, rank: int = 0) -> None:
        """Binds the PUB socket at `endpoint` (tcp://host:port) and the replay socket at port + 1, and
        turns `recorder` on."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint(endpoint)
        self.recorder = recorder
        self.rank = rank
        self.index = BlockIndex(keep_tokens=True)
        self.seq = time.time_ns() - 1  # of the last batch sent (publisher thread); above any before a restart
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)  # (seq, payload)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(endpoint)
            self._router.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise UserError(f"--kv-events-endpoint {endpoint}: cannot bind it and port + 1 ({exc})") from exc
        self._batches: queue.SimpleQueue[tuple[float, list]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        recorder.enabled = True
        logger.info("KV events on %s (replay on %s)", endpoint, self.replay_endpoint)

    def publish(self) -> None:
        """Scheduler thread, after a step: send what it stored and dropped (nothing if nothing changed)."""
        events = self.recorder.drain()
        if events:
            self._batches.put((time.time(), events))

    def close(self) -> None:
        self.recorder.enabled = False
        self._stopped.set()
        self._thread.join()
        self._ctx.destroy(linger=0)

    # ---- the publisher thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                readable = self._router.poll(POLL_MS)
                self._send_batches()
                if readable:
                    self._answer()
            except Exception:  # one bad request must not end the events: logged, and on to the next
                logger.exception("KV events publisher")
        self._send_batches()

    def _send_batches(self) -> None:
        while True:
            try:
                ts, events = self._batches.get_nowait()
            except queue.Empty:
                return
            wire = []
            for event in events:
                for out in wire_events(event, self.recorder.page_size, self.index.pages):
                    self.index.apply(out)
                    wire.append(out)
            self.seq += 1
            payload = encode_payload(KVEventBatch(ts, wire, self.rank))
            self._pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), payload])
            self._buffer.append((self.seq, payload))

    def _answer(self) -> None:
        while self._router.poll(0):
            frames = self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: a replay request is [b'', seq (8 bytes)]; %d frames ignored", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self._replay(start):
                self._router.send_multipart([identity, b"", TOPIC, seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """The batches a subscriber that has applied everything before `start` needs: from the buffer
        where it reaches back that far, else the state as one batch numbered as the last one sent."""
        if start == self.seq + 1:
            return []
        if self._buffer and self._buffer[0][0] <= start <= self.seq:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start]
        state = KVEventBatch(time.time(), self.index.state_events(), self.rank)
        return [(self.seq, encode_payload(state))]
