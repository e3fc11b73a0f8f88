"""P/D disaggregation: the prefill side of the ZeroMQ transport (a `KVTransferBackend` and its senders).

Each prefill rank binds one ROUTER socket at bootstrap host:port + rank; the decode ranks that share
KV with it (cells.py) connect DEALERs to it, ask once for its server's topology (HELLO) and send each
request's metadata (wire.py), which may arrive before the request (the router sends both halves at
once): it waits in `_early` until the request arrives or the transfer times out. Sending runs on the
I/O thread, in messages of about kv_rows.CHUNK_BYTES (`chunk_tokens`), each read out of the request's
locked device pages just before it goes and sent to every decode peer in turn; the next is queued
behind what arrived meanwhile, so an abort stops it at the next message, and a chunk that cannot be
read fails its transfer, decode told. Frames go to ZeroMQ uncopied and tracked: a transfer reads its
next chunk once at most one earlier chunk is still queued, so it holds at most two chunks of host memory
(docs/DESIGN.md, "P/D streaming"). ROUTER_MANDATORY: a send to a decode that is gone is an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from hicache.disagg import cells, wire
from hicache.disagg.handshake import Handshake
from hicache.disagg.kv_rows import frames_of
from hicache.disagg.transfer import DecodeMetadata, KVPoll, KVSource, PrefillResult
from hicache.disagg.zmq_io import IOLoop
from hicache.errors import UserError
from hicache.scheduler.request import Bootstrap
from hicache.storage.unified import Shard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Peer:
    """A decode rank this rank owes cells for a request."""

    identity: bytes  # its DEALER
    meta: DecodeMetadata
    cuts: tuple[cells.Cut, ...]  # where its cells lie in this rank's rows (the target's, a draft's)
    word_every_s: float  # how often it needs WORKING while the request is queued or computing


@dataclass(eq=False)
class _Room:
    room: int
    deadline: float  # for decode's metadata; once sent, for decode's acks
    status: KVPoll = KVPoll.BOOTSTRAPPING
    meta: DecodeMetadata | None = None  # once every peer's metadata is in (they agree)
    expected: dict[int, Shard] | None = None  # decode rank -> its cells, from the first metadata
    peers: dict[int, _Peer] = field(default_factory=dict)  # decode rank -> who asked
    acked: set[bytes] = field(default_factory=set)
    error: str | None = None
    reading: bool = False  # the I/O thread may still read the request's pages (transfer.KVSender.reading)
    next_word: float = 0.0  # when decode may next be told the request is still worked on (WORKING)

    @property
    def identities(self) -> list[bytes]:
        return [peer.identity for peer in self.peers.values()]


@dataclass(eq=False)
class _Early:
    """Messages for a room this rank has not seen yet, or the reason a room it ended has ended."""

    when: float
    messages: list[tuple[str, bytes, Any]] = field(default_factory=list)
    ended: str | None = None


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

    def working(self) -> None:
        self._backend.working(self._state)

    def send(self, kv: KVSource, result: PrefillResult) -> None:
        with self._backend.lock:
            if self._state.status is not KVPoll.WAITING_FOR_INPUT:
                return  # aborted meanwhile: decode was told
            self._state.status, self._state.reading = KVPoll.TRANSFERRING, True
            self._state.deadline = time.monotonic() + self._backend.timeout_s + self._backend.send_allowance(kv)
        self._backend.io.call(lambda: self._backend.transmit(self._state, kv, result, kv.start))

    @property
    def reading(self) -> bool:
        return self._state.reading

    def abort(self, reason: str) -> None:
        self._backend.abort(self._state, reason)

    def failure(self) -> str | None:
        return self._state.error


class ZmqPrefillBackend:
    """transfer.KVTransferBackend for a prefill rank."""

    def __init__(
        self, handshake: Handshake, host: str, port: int, timeout_s: float, chunk_tokens: int,
        chunk_delay_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.handshake = handshake
        self.endpoint = f"tcp://{host}:{port}"
        self.timeout_s = timeout_s
        self.chunk_tokens = chunk_tokens
        self.chunk_delay_s = chunk_delay_s
        self.lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._early: dict[int, _Early] = {}
        self.moved_bytes = 0  # handed to the socket (transfer.KVTransferBackend.moved_bytes)
        self.staged_bytes = 0  # read out of the pool and not yet released by ZeroMQ (I/O thread)
        self.peak_staged_bytes = 0  # the most staged at once (transfer.KVTransferBackend.peak_staged_bytes)
        self._queued: deque[_Queued] = deque()  # chunks ZeroMQ still holds, oldest first (I/O thread)
        self.io = IOLoop("hicache-kv-prefill", tick=self._tick)
        self._router = self.io.ctx.socket(zmq.ROUTER)
        self._router.copy_threshold = 0  # every frame zero-copy and tracked, so none is staged unseen
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

    def send_allowance(self, kv: KVSource) -> float:
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
            for message in early.messages if early is not None else ():
                self._take(state, message)
        return ZmqKVSender(self, state)

    def working(self, state: _Room) -> None:
        """Send each decode peer WORKING, as often as the most pressed of them asked (a quarter of its
        timeout: the word arrives well inside it however the step lengths fall)."""
        now = time.monotonic()
        with self.lock:
            if state.status is not KVPoll.WAITING_FOR_INPUT or now < state.next_word:
                return
            state.next_word = now + min(peer.word_every_s for peer in state.peers.values())
            identities = state.identities
        message = wire.encode(wire.WORKING, {"room": state.room})
        for identity in identities:
            self.io.call(lambda identity=identity: self._send(identity, message))

    def abort(self, state: _Room, reason: str) -> None:
        with self.lock:
            if state.status in (KVPoll.FAILED, KVPoll.SUCCESS):
                self._rooms.pop(state.room, None)
                return
            self._fail(state, reason)
            if len(state.peers) < len(state.expected or (None,)):  # more metadata may come: answer it
                self._early[state.room] = _Early(time.monotonic(), ended=reason)

    def _fail(self, state: _Room, reason: str, *also: bytes) -> None:
        """Lock held: end the room and tell every decode peer that asked so far (and `also`) why."""
        state.status, state.error = KVPoll.FAILED, reason
        self._rooms.pop(state.room, None)
        header = {"room": state.room, "reason": reason}
        for identity in {*state.identities, *also}:
            self.io.call(lambda identity=identity: self._send(identity, wire.encode(wire.ERROR, header)))

    def shutdown(self) -> None:
        def close() -> None:
            with self.lock:
                for state in self._rooms.values():
                    state.reading = False  # the I/O thread has stopped
                    if state.status not in (KVPoll.FAILED, KVPoll.SUCCESS):
                        state.status, state.error = KVPoll.FAILED, "the prefill server is shutting down"
                self._rooms.clear()

        self.io.stop(close)

    # ---- I/O thread --------------------------------------------------------------------------------

    def _take(self, state: _Room, message: tuple[str, bytes, Any]) -> None:
        """Apply a decode rank's metadata or abort to its room (lock held)."""
        what, identity, payload = message
        if what == "abort":
            if state.status not in (KVPoll.FAILED, KVPoll.SUCCESS):
                self._fail(state, f"decode aborted the request: {payload}")
            return
        if state.status is not KVPoll.BOOTSTRAPPING:
            return
        meta, every = payload
        mine = self.handshake
        try:
            if state.expected is None:  # the first decode rank names its server's topology
                state.expected = cells.peers(self.handshake, meta.handshake)
            decode_rank = cells.rank(meta.handshake)
            if decode_rank not in state.expected:
                raise ValueError(f"decode rank {decode_rank} shares no KV with this prefill rank")
            first = next(iter(state.peers.values()), None)
            if first is not None and _request(first.meta) != _request(meta):
                raise ValueError(f"decode ranks disagree on the request: {_request(first.meta)}, {_request(meta)}")
            draft = cells.sends_draft(mine, meta.handshake)
            cuts = cells.cuts(mine, state.expected[decode_rank], draft)
            state.peers[decode_rank] = _Peer(identity, meta, cuts, every)
        except ValueError as exc:  # another model or topology than this rank can serve: refuse it by name
            self._fail(state, f"refused decode's metadata: {exc}", identity)
            return
        if len(state.peers) == len(state.expected):
            state.meta, state.status = meta, KVPoll.WAITING_FOR_INPUT

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
        if kind == wire.HELLO:
            self._send(identity, wire.encode(wire.LAYOUT, {"room": 0, "handshake": self.handshake.to_json()}))
            return
        room = header["room"]
        reply: str | None = None
        with self.lock:
            state = self._rooms.get(room)
            message: tuple[str, bytes, Any] | None = None
            if kind == wire.META:
                message = ("meta", identity, (wire.parse_metadata(header), wire.word_every(header)))
            elif kind == wire.ABORT:
                message = ("abort", identity, str(header.get("reason", "")))
            elif kind == wire.ACK and state is not None and state.status is KVPoll.TRANSFERRING:
                state.acked.add(identity)
                if state.acked >= set(state.identities):  # every decode peer has its cells
                    state.status = KVPoll.SUCCESS
                    del self._rooms[room]
            if message is not None and state is not None:
                self._take(state, message)
            elif message is not None:
                early = self._early.setdefault(room, _Early(time.monotonic()))
                if early.ended is not None:
                    reply = early.ended
                else:
                    early.messages.append(message)
        if reply is not None and kind == wire.META:
            self._send(identity, wire.encode(wire.ERROR, {"room": room, "reason": reply}))

    def transmit(self, state: _Room, kv: KVSource, result: PrefillResult, start: int) -> None:
        """Read the chunk of rows from `start` out of the pool and send each decode peer its cells; queue
        the next chunk behind what arrived meanwhile, or after the last, send each peer the first token."""
        end = min(kv.end, start - start % self.chunk_tokens + self.chunk_tokens)
        sent = False
        try:
            sent = self._send_rows(state, kv, start, end)
        except Exception as exc:  # a fault reading or cutting the rows: fail this transfer, tell decode now
            logger.exception("room %d: reading rows [%d, %d) failed", state.room, start, end)
            with self.lock:
                if state.status is KVPoll.TRANSFERRING:  # not already ended (an abort, a peer gone)
                    self._fail(state, f"prefill failed to read rows [{start}, {end}): {exc!r}")
        finally:
            if not sent or end == kv.end:
                state.reading = False  # nothing reads the request's pages any more: they may go
        if not sent:
            return
        if end < kv.end:
            self.io.call(lambda: self.transmit(state, kv, result, end))
            return
        with self.lock:
            state.deadline = time.monotonic() + self.timeout_s  # now waiting for the acks
        done = wire.encode(wire.DONE, wire.result_header(state.room, kv.end, result))
        for peer in state.peers.values():
            if self._send(peer.identity, done, state) is None:
                return

    def _send_rows(self, state: _Room, kv: KVSource, start: int, end: int) -> bool:
        """One message of rows [start, end) to every decode peer, read once the transfer's window has
        room; False when the transfer has ended (aborted, a peer gone or not taking its KV)."""
        if self.chunk_delay_s:
            time.sleep(self.chunk_delay_s)
        if state.status is not KVPoll.TRANSFERRING or not self._wait_for_window(state):
            return False
        chunk = kv.read(start, end, {layer for peer in state.peers.values() for c in peer.cuts for layer in c.layers})
        messages = [(peer, frames_of(chunk, peer.cuts)) for peer in state.peers.values()]
        # A cut of part of each row is a copy, held as long as the chunk.
        partial = [peer for peer in state.peers.values() if not all(c.whole_rows for c in peer.cuts)]
        copies = sum(f.nbytes for peer, frames in messages if peer in partial for f in frames)
        queued = _Queued(state, sum(rows.nbytes for rows in chunk.values()) + copies)
        self._stage(queued)
        header: dict[str, Any] = {"room": state.room, "start": start, "end": end}
        if (held := kv.held(start, end)) is not None:  # a page-sharded pool: rows of these pages only (cells.py)
            header["pages"] = held
        for peer, frames in messages:
            if state.status is not KVPoll.TRANSFERRING:
                return False  # aborted: decode was told
            tracker = self._send(peer.identity, [*wire.encode(wire.KV, header), *frames], state)
            if tracker is None:
                return False
            queued.trackers.append(tracker)
            self.moved_bytes += sum(f.nbytes for f in frames)
        return True

    def _stage(self, queued: _Queued) -> None:
        self._queued.append(queued)
        self.staged_bytes += queued.nbytes
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def _release_sent(self) -> None:
        """Forget the chunks ZeroMQ has written out (or dropped with a peer that left)."""
        while self._queued and self._queued[0].sent:
            self.staged_bytes -= self._queued.popleft().nbytes

    def _wait_for_window(self, state: _Room) -> bool:
        """Block until at most one earlier chunk of `state` is still queued (False: its deadline passed
        first, and the transfer is failed: a decode that does not read its KV)."""
        while True:
            self._release_sent()
            mine = [queued for queued in self._queued if queued.state is state and not queued.sent]
            if len(mine) <= 1:
                return True
            try:
                for tracker in mine[0].trackers:
                    tracker.wait(max(0.0, state.deadline - time.monotonic()))
            except zmq.NotDone:
                with self.lock:
                    self._fail(state, "decode did not take its KV within the transfer timeout")
                return False

    def _send(self, identity: bytes, frames: list, state: _Room | None = None) -> zmq.MessageTracker | None:
        """Hand a message to ZeroMQ without a copy: its tracker (done once ZeroMQ has written it out), or
        None when the decode that asked is gone (`state` is failed then)."""
        try:
            return self._router.send_multipart([identity, *frames], copy=False, track=True)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the decode that asked is gone
            if state is not None:
                with self.lock:
                    self._fail(state, f"decode went away mid-transfer ({exc})")
            return None

    def _tick(self) -> None:
        self._release_sent()
        now = time.monotonic()
        with self.lock:
            for room, early in list(self._early.items()):
                if now - early.when > self.timeout_s:
                    del self._early[room]
            for room, state in list(self._rooms.items()):
                if state.status is KVPoll.TRANSFERRING and now > state.deadline:
                    self._fail(state, "decode never acknowledged the transfer")


@dataclass(eq=False)
class _Queued:
    """A chunk's host bytes, held until ZeroMQ has written every message of it. A message is tracked by
    its last frame: ZeroMQ writes a message's frames in order, and drops them together with its peer."""

    state: _Room
    nbytes: int
    trackers: list[zmq.MessageTracker] = field(default_factory=list)

    @property
    def sent(self) -> bool:
        return all(tracker.done for tracker in self.trackers)


def _request(meta: DecodeMetadata) -> tuple[int, int, str]:
    """What every decode rank of one request must say alike."""
    return meta.decode_prefix_len, meta.prompt_len, meta.prompt_digest
