"""P/D disaggregation: the decode side of the ZeroMQ transport (a `KVTransferBackend` and its receivers).

A decode rank keeps one DEALER per prefill endpoint it has been sent to (host:port + this rank's
index), connected on first use, with a socket monitor: when the connection to a prefill server drops,
every transfer still waiting on it fails at once ("disconnected mid-transfer") instead of at its
timeout. Arriving KV messages are checked (the room's next expected token, within the prompt) and
written straight into the request's reserved device pages on the I/O thread, under the backend's lock;
`abort` takes the same lock, so once it returns nothing more is written and the pages may be freed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from hicache.disagg import wire
from hicache.disagg.kv_rows import land
from hicache.disagg.transfer import DecodeMetadata, KVPoll, PrefillResult
from hicache.disagg.zmq_io import IOLoop
from hicache.mem.device_pool import DeviceKVPool
from hicache.scheduler.request import Bootstrap

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Room:
    room: int
    endpoint: str
    status: KVPoll = KVPoll.BOOTSTRAPPING
    meta: DecodeMetadata | None = None
    slots: torch.Tensor | None = None  # device slots of tokens [decode_prefix_len, prompt_len)
    next: int = 0  # the next token whose KV is expected
    deadline: float = 0.0  # fails when nothing arrives before this
    result: PrefillResult | None = None
    error: str | None = None


class ZmqKVReceiver:
    """One request's receiver (transfer.KVReceiver)."""

    def __init__(self, backend: ZmqDecodeBackend, state: _Room) -> None:
        self._backend = backend
        self._state = state
        self.room = state.room

    def init(self, slots: torch.Tensor, metadata: DecodeMetadata) -> None:
        self._backend.start(self._state, slots, metadata)

    def poll(self) -> KVPoll:
        b = self._backend
        with b.lock:
            s = self._state
            if s.status in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING) and time.monotonic() > s.deadline:
                b.fail(s, f"no KV from the prefill server at {s.endpoint} within {b.timeout_s:.0f} s")
            return s.status

    def result(self) -> PrefillResult | None:
        return self._state.result

    def abort(self, reason: str) -> None:
        self._backend.abort(self._state, reason)

    def failure(self) -> str | None:
        return self._state.error


class ZmqDecodeBackend:
    """transfer.KVTransferBackend for a decode rank: KV lands in `pool`."""

    def __init__(self, pool: DeviceKVPool, rank: int, timeout_s: float) -> None:
        self.pool = pool
        self.rank = rank
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}  # transfers in flight (metadata sent, not ended)
        self.moved_bytes = 0  # landed in the pool (transfer.KVTransferBackend.moved_bytes)
        self._dealers: dict[str, zmq.Socket] = {}  # I/O thread only
        self._monitors: dict[str, zmq.Socket] = {}
        self.io = IOLoop("hicache-kv-decode")
        self.io.start()

    # ---- scheduler thread ------------------------------------------------------------------------

    def receiver(self, bootstrap: Bootstrap) -> ZmqKVReceiver:
        endpoint = f"tcp://{bootstrap.host}:{bootstrap.port + self.rank}"
        return ZmqKVReceiver(self, _Room(bootstrap.room, endpoint))

    def start(self, state: _Room, slots: torch.Tensor, meta: DecodeMetadata) -> None:
        with self.lock:
            if state.status is not KVPoll.BOOTSTRAPPING:
                return
            if meta.room in self._rooms:
                self.fail(state, f"bootstrap room {meta.room} is already in use on this decode server")
                return
            state.meta, state.slots, state.next = meta, slots, meta.decode_prefix_len
            state.status, state.deadline = KVPoll.WAITING_FOR_INPUT, time.monotonic() + self.timeout_s
            self._rooms[meta.room] = state
        header = wire.metadata_header(meta)
        self.io.call(lambda: self._dealer(state.endpoint).send_multipart(wire.encode(wire.META, header)))

    def abort(self, state: _Room, reason: str) -> None:
        with self.lock:  # no landing is in progress while this is held
            if state.status in (KVPoll.FAILED, KVPoll.SUCCESS):
                return
            self.fail(state, reason)
        # Even before any metadata was sent: prefill may hold the request, waiting for it.
        header = {"room": state.room, "reason": reason}
        self.io.call(lambda: self._dealer(state.endpoint).send_multipart(wire.encode(wire.ABORT, header)))

    def fail(self, state: _Room, reason: str) -> None:
        """Lock held."""
        state.status, state.error = KVPoll.FAILED, reason
        if self._rooms.get(state.room) is state:
            del self._rooms[state.room]

    def shutdown(self) -> None:
        def close() -> None:
            with self.lock:
                for state in list(self._rooms.values()):
                    self.fail(state, "the decode server is shutting down")

        self.io.stop(close)

    # ---- I/O thread --------------------------------------------------------------------------------

    def _dealer(self, endpoint: str) -> zmq.Socket:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self.io.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(endpoint)
            self._dealers[endpoint] = sock
            self._monitors[endpoint] = monitor
            self.io.watch(sock, lambda: self._on_readable(sock, endpoint))
            self.io.watch(monitor, lambda: self._on_monitor(monitor, endpoint))
        return sock

    def _on_monitor(self, monitor: zmq.Socket, endpoint: str) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                with self.lock:
                    lost = [s for s in self._rooms.values() if s.endpoint == endpoint]
                    for state in lost:
                        self.fail(state, f"the prefill server at {endpoint} disconnected mid-transfer")
                if lost:
                    logger.warning("prefill at %s disconnected: %d transfers failed", endpoint, len(lost))

    def _on_readable(self, sock: zmq.Socket, endpoint: str) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                kind, header, payload = wire.decode([f.buffer for f in frames])
            except wire.WireError as exc:
                logger.warning("dropped a malformed KV transfer message from %s: %s", endpoint, exc)
                continue
            reply = self._on_message(kind, header, payload)
            if reply is not None:
                sock.send_multipart(reply)

    def _on_message(self, kind: bytes, header: dict[str, Any], payload: list[memoryview]) -> list[bytes] | None:
        """Apply one message; the reply to send back, if any."""
        room = header["room"]
        with self.lock:
            state = self._rooms.get(room)
            if state is None:
                return None  # aborted, failed or finished here: late messages are dropped
            assert state.meta is not None and state.slots is not None
            try:
                if kind == wire.KV:
                    self._land(state, int(header["start"]), int(header["end"]), payload)
                    return None
                if kind == wire.DONE:
                    if int(header.get("end", -1)) != state.meta.prompt_len or state.next != state.meta.prompt_len:
                        raise ValueError(f"done at token {state.next} of {state.meta.prompt_len}")
                    state.result = wire.parse_result(header)
                    state.status = KVPoll.SUCCESS
                    del self._rooms[room]
                    return wire.encode(wire.ACK, {"room": room})
                if kind == wire.ERROR:
                    self.fail(state, f"prefill failed the request: {header.get('reason', 'no reason given')}")
                return None
            except (ValueError, KeyError, TypeError) as exc:
                reason = f"a bad KV message from {state.endpoint}: {exc}"
                self.fail(state, reason)
                return wire.encode(wire.ABORT, {"room": room, "reason": reason})

    def _land(self, state: _Room, start: int, end: int, payload: list[memoryview]) -> None:
        """Lock held. Raises ValueError for a message out of order or outside the prompt."""
        assert state.meta is not None and state.slots is not None
        if start != state.next or not start < end <= state.meta.prompt_len:
            raise ValueError(f"rows [{start}, {end}) when token {state.next} was expected")
        base = state.meta.decode_prefix_len
        self.moved_bytes += land(self.pool, state.slots[start - base : end - base], payload)
        state.next = end
        state.status = KVPoll.TRANSFERRING
        state.deadline = time.monotonic() + self.timeout_s
