"""The KV events publisher (docs/DESIGN.md, "KV events"): one per server, on rank 0 (every rank of the
tree-sharing group keeps the same tree, so rank 0 speaks for them), behind `--kv-events-endpoint`.

The scheduler thread calls `publish` after every step: it drains the cache's recorder (what the step
stored and dropped) and hands the batch to the publisher's thread, which numbers it, applies it to its
own `BlockIndex` and sends it on the PUB socket (wire.py). The same thread answers snapshot requests on a
ROUTER socket beside it, from that index, after sending every batch queued before the request: the
snapshot is the state at exactly its seq. ZeroMQ sockets are not thread-safe, so both live on that one
thread, and a slow subscriber never holds up a step (PUB drops for it; it then resynchronises).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time

import zmq

from hicache.cache import KVEventRecorder
from hicache.errors import UserError
from hicache.events.index import BlockIndex
from hicache.events.wire import SNAPSHOT_REQUEST, Batch, encode_batch, encode_snapshot, snapshot_endpoint

logger = logging.getLogger(__name__)

POLL_MS = 20  # the longest a batch waits on the publisher thread before it is sent


class KVEventPublisher:
    def __init__(self, endpoint: str, recorder: KVEventRecorder, rank: int = 0) -> None:
        """Binds the PUB socket at `endpoint` (tcp://host:port) and the snapshot socket at port + 1, and
        turns `recorder` on."""
        self.endpoint = endpoint
        self.snapshot_endpoint = snapshot_endpoint(endpoint)
        self.recorder = recorder
        self.rank = rank
        self.epoch = secrets.token_hex(8)  # a restarted server's seq starts again: subscribers see a new epoch
        self.index = BlockIndex()
        self.seq = 0  # of the last batch sent (publisher thread)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(endpoint)
            self._router.bind(self.snapshot_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise UserError(f"--kv-events-endpoint {endpoint}: cannot bind it and port + 1 ({exc})") from exc
        self._batches: queue.SimpleQueue[tuple[float, list]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        recorder.enabled = True
        logger.info("KV events on %s (snapshots on %s)", endpoint, self.snapshot_endpoint)

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
            except Exception:  # noqa: BLE001 - one bad request must not end the events: logged, next
                logger.exception("KV events publisher")
        self._send_batches()

    def _send_batches(self) -> None:
        while True:
            try:
                ts, events = self._batches.get_nowait()
            except queue.Empty:
                return
            self.seq += 1
            for event in events:
                self.index.apply(event)
            batch = Batch(self.epoch, self.seq, ts, self.rank, self.recorder.page_size, events)
            self._pub.send_multipart(encode_batch(batch))

    def _answer(self) -> None:
        while self._router.poll(0):
            identity, *request = self._router.recv_multipart()
            if request[-1:] != [SNAPSHOT_REQUEST]:
                logger.warning("KV events: unknown request %r ignored", request[-1:])
                continue
            reply = encode_snapshot(self.epoch, self.seq, self.rank, self.recorder.page_size, self.index.blocks())
            self._router.send_multipart([identity, *request[:-1], *reply])
