"""P/D disaggregation: the prefill side of the ZeroMQ transport (a `KVTransferBackend` and its senders).

Each prefill rank binds one ROUTER socket at bootstrap host:port + rank; the decode ranks that pair with
it connect DEALERs to it and send each request's metadata (wire.py). Metadata may arrive before the
request it names does (the router sends both halves at once): it waits in `_early` until the request
arrives, or until the transfer timeout. Sending is done on the I/O thread, in messages of about
kv_rows.CHUNK_BYTES; an abort stops it at the next message. ROUTER_MANDATORY makes a send to a decode
that went away an error instead of a silent drop.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from hicache.disagg import wire
from hicache.disagg.kv_rows import frames_of
from hicache.disagg.transfer import DecodeMetadata, KVPoll, PrefillResult, StagedKV
from hicache.disagg.zmq_io import IOLoop
from hicache.errors import UserError
from hicache.scheduler.request import Bootstrap

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Room:
    room: int
    deadline: float  # for decode's metadata; once sent, for decode's ack
    status: KVPoll = KVPoll.BOOTSTRAPPING
    meta: DecodeMetadata | None = None
    identity: bytes | None = None  # the decode DEALER that sent the metadata
    error: str | None = None


class ZmqKVSender:
    """One request's sender (transfer.KVSender)."""

    def __init__(self, backend: ZmqPrefillBackend, state: _Room) -> None:
        self._backend = backend
        self._state = state
        self.room = state.room

    def poll(self) -> KVPoll:
        with self._backend.lock:
            s = self._state
            if s.status is KVPoll.BOOTSTRAPPING and time.monotonic() > s.deadline:
                s.status, s.error = KVPoll.FAILED, f"no metadata from decode within {self._backend.timeout_s:.0f} s"
            return s.status

    def metadata(self) -> DecodeMetadata | None:
        return self._state.meta

    def send(self, kv: StagedKV, result: PrefillResult) -> None:
        with self._backend.lock:
            if self._state.status is not KVPoll.WAITING_FOR_INPUT:
                return  # aborted meanwhile: decode was told
            self._state.status = KVPoll.TRANSFERRING
            self._state.deadline = time.monotonic() + self._backend.timeout_s + self._backend.send_allowance(kv)
        self._backend.io.call(lambda: self._backend.transmit(self._state, kv, result))

    def abort(self, reason: str) -> None:
        self._backend.abort(self._state, reason)

    def failure(self) -> str | None:
        return self._state.error


class ZmqPrefillBackend:
    """transfer.KVTransferBackend for a prefill rank."""

    def __init__(self, host: str, port: int, timeout_s: float, chunk_tokens: int, chunk_delay_s: float = 0.0):
        self.endpoint = f"tcp://{host}:{port}"
        self.timeout_s = timeout_s
        self.chunk_tokens = chunk_tokens
        self.chunk_delay_s = chunk_delay_s
        self.lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        # Messages for rooms this rank has not seen yet (metadata first) or has already ended (an abort):
        # room -> (what, identity, payload, when).
        self._early: dict[int, tuple[str, bytes, Any, float]] = {}
        self.moved_bytes = 0  # handed to the socket (transfer.KVTransferBackend.moved_bytes)
        self.io = IOLoop("hicache-kv-prefill", tick=self._tick)
        self._router = self.io.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            self._router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.io.ctx.destroy(linger=0)
            raise UserError(f"cannot listen for KV transfers on {self.endpoint}: {exc}") from None
        self.io.watch(self._router, self._on_readable)
        self.io.start()
        logger.info("prefill KV transfer endpoint on %s", self.endpoint)

    # ---- scheduler thread ------------------------------------------------------------------------

    def send_allowance(self, kv: StagedKV) -> float:
        """Extra seconds a transfer may take for its debug delays (none without fault injection)."""
        chunks = -(-(kv.end - kv.start) // self.chunk_tokens)
        return chunks * self.chunk_delay_s

    def sender(self, bootstrap: Bootstrap, prompt_len: int) -> ZmqKVSender:
        state = _Room(bootstrap.room, time.monotonic() + self.timeout_s)
        with self.lock:
            early = self._early.pop(bootstrap.room, None)
            if bootstrap.room in self._rooms:
                state.status, state.error = KVPoll.FAILED, f"bootstrap room {bootstrap.room} is already in use"
                return ZmqKVSender(self, state)
            self._rooms[state.room] = state
            if early is not None:
                self._take(state, early)
        return ZmqKVSender(self, state)

    def abort(self, state: _Room, reason: str) -> None:
        with self.lock:
            if state.status in (KVPoll.FAILED, KVPoll.SUCCESS):
                self._rooms.pop(state.room, None)
                return
            state.status, state.error = KVPoll.FAILED, reason
            self._rooms.pop(state.room, None)
            identity = state.identity
            if identity is None:  # decode's metadata may still come: answer it with the reason
                self._early[state.room] = ("ended", b"", reason, time.monotonic())
        if identity is not None:
            self.io.call(lambda: self._send(identity, wire.encode(wire.ERROR, {"room": state.room, "reason": reason})))

    def shutdown(self) -> None:
        def close() -> None:
            with self.lock:
                for state in self._rooms.values():
                    if state.status not in (KVPoll.FAILED, KVPoll.SUCCESS):
                        state.status, state.error = KVPoll.FAILED, "the prefill server is shutting down"
                self._rooms.clear()

        self.io.stop(close)

    # ---- I/O thread --------------------------------------------------------------------------------

    def _take(self, state: _Room, early: tuple[str, bytes, Any, float]) -> None:
        """Apply a message that came before its room (lock held)."""
        what, identity, payload, _ = early
        if what == "meta" and state.status is KVPoll.BOOTSTRAPPING:
            state.meta, state.identity, state.status = payload, identity, KVPoll.WAITING_FOR_INPUT
        elif what == "abort":
            state.status, state.error = KVPoll.FAILED, f"decode aborted the request: {payload}"
            self._rooms.pop(state.room, None)

    def _on_readable(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = frames[0]
            try:
                kind, header, _ = wire.decode(frames[1:])
                self._on_message(identity, kind, header)
            except wire.WireError as exc:
                logger.warning("dropped a malformed KV transfer message: %s", exc)

    def _on_message(self, identity: bytes, kind: bytes, header: dict[str, Any]) -> None:
        room = header["room"]
        reply: str | None = None
        with self.lock:
            state = self._rooms.get(room)
            if kind == wire.META:
                meta = wire.parse_metadata(header)
                if state is None:
                    ended = self._early.get(room)
                    if ended is not None and ended[0] == "ended":
                        reply = ended[2]
                    else:
                        self._early[room] = ("meta", identity, meta, time.monotonic())
                else:
                    self._take(state, ("meta", identity, meta, 0.0))
            elif kind == wire.ACK and state is not None:
                state.status = KVPoll.SUCCESS
                del self._rooms[room]
            elif kind == wire.ABORT:
                reason = str(header.get("reason", ""))
                if state is None:
                    self._early[room] = ("abort", identity, reason, time.monotonic())
                else:
                    self._take(state, ("abort", identity, reason, 0.0))
        if reply is not None:
            self._send(identity, wire.encode(wire.ERROR, {"room": room, "reason": reply}))

    def transmit(self, state: _Room, kv: StagedKV, result: PrefillResult) -> None:
        """Send the staged KV in page-aligned messages, then the first token."""
        assert state.identity is not None
        start = kv.start
        while start < kv.end:
            end = min(kv.end, start - start % self.chunk_tokens + self.chunk_tokens)
            if self.chunk_delay_s:
                time.sleep(self.chunk_delay_s)
            if state.status is not KVPoll.TRANSFERRING:
                return  # aborted: decode was told
            header = {"room": state.room, "start": start, "end": end}
            frames = frames_of(kv, start, end)
            if not self._send(state.identity, [*wire.encode(wire.KV, header), *frames], state):
                return
            self.moved_bytes += sum(f.nbytes for f in frames)
            start = end
        with self.lock:
            state.deadline = time.monotonic() + self.timeout_s  # now waiting for the ack
        self._send(state.identity, wire.encode(wire.DONE, wire.result_header(state.room, kv.end, result)), state)

    def _send(self, identity: bytes, frames: list, state: _Room | None = None) -> bool:
        try:
            self._router.send_multipart([identity, *frames], copy=False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the decode that asked is gone
            if state is not None:
                with self.lock:
                    state.status, state.error = KVPoll.FAILED, f"decode went away mid-transfer ({exc})"
                    self._rooms.pop(state.room, None)
            return False

    def _tick(self) -> None:
        now = time.monotonic()
        with self.lock:
            for room, (_, _, _, when) in list(self._early.items()):
                if now - when > self.timeout_s:
                    del self._early[room]
            for room, state in list(self._rooms.items()):
                if state.status is KVPoll.TRANSFERRING and now > state.deadline:
                    state.status, state.error = KVPoll.FAILED, "decode never acknowledged the transfer"
                    del self._rooms[room]
