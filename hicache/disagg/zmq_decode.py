"""P/D disaggregation: the decode side of the ZeroMQ transport (a `KVTransferBackend` and its receivers).

A decode rank takes its shard of each request's KV from every prefill rank it overlaps (cells.py), so
it first learns the prefill server's topology: it asks that server's rank 0 once (HELLO; the answer is
kept until that connection drops) and then sends the request's metadata to each of its sources. It
keeps one DEALER per prefill endpoint (host:port + rank), connected on first use, with a socket
monitor: when the connection to a prefill rank drops, every transfer still waiting on it fails at once
("disconnected mid-transfer") instead of at its timeout. Arriving KV messages are checked (the source's
next expected token, within the prompt) and written straight into the request's reserved device pages
on the I/O thread, under the backend's lock; `abort` takes the same lock, so once it returns nothing
more is written and the pages may be freed. The request has landed when every source has said DONE
and, where prefill's pages are sharded (CP, MLA's TP), its ranks have sent every page of each cell
between them, each page once (cells.py, "page ownership"); a decode rank with sharded pages of its own
keeps the rows of the pages it owns.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from hicache.disagg import cells, wire
from hicache.disagg.handshake import Handshake
from hicache.disagg.kv_rows import land, tokens_of
from hicache.disagg.transfer import DecodeMetadata, KVPoll, PrefillResult
from hicache.disagg.zmq_io import IOLoop
from hicache.mem.device_pool import DeviceKVPool
from hicache.scheduler.request import Bootstrap

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Source:
    """A prefill rank this rank takes cells from, for one request."""

    cuts: tuple[cells.Cut, ...]  # where its cells land in this rank's rows (the target's, a draft's)
    next: int  # the next token whose KV is expected from it
    sharded: bool = False  # it holds only its own pages, and sends those (cells.py, "page ownership")
    done: bool = False


@dataclass(eq=False)
class _Room:
    room: int
    server: str  # the prefill server's rank-0 endpoint, which answers HELLO
    status: KVPoll = KVPoll.BOOTSTRAPPING
    meta: DecodeMetadata | None = None
    slots: torch.Tensor | None = None  # device slots of tokens [decode_prefix_len, prompt_len)
    sources: dict[str, _Source] = field(default_factory=dict)  # by endpoint; empty until the layout is known
    # Pages landed from page-sharded sources, by the cells they carry: each page once, from its owner.
    landed: dict[tuple[cells.Cut, ...], set[int]] = field(default_factory=dict)
    deadline: float = 0.0  # fails when nothing arrives before this
    result: PrefillResult | None = None
    error: str | None = None

    @property
    def endpoints(self) -> list[str]:
        """Where this request is known to prefill (its sources, or before they are known the server)."""
        return list(self.sources) or [self.server]


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
                b.fail(s, f"no word from the prefill server at {s.server} within {b.timeout_s:.0f} s")
            return s.status

    def result(self) -> PrefillResult | None:
        return self._state.result

    def abort(self, reason: str) -> None:
        self._backend.abort(self._state, reason)

    def failure(self) -> str | None:
        return self._state.error


class ZmqDecodeBackend:
    """transfer.KVTransferBackend for a decode rank: KV lands in `pool` (and a draft's in `draft`)."""

    def __init__(
        self, pool: DeviceKVPool, handshake: Handshake, timeout_s: float, draft: DeviceKVPool | None = None
    ) -> None:
        self.pool = pool
        self.buffers = pool.buffers + (draft.buffers if draft is not None else [])  # as cells.cuts numbers them
        self.handshake = handshake
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}  # transfers in flight (metadata sent, not ended)
        self._layouts: dict[str, Handshake] = {}  # prefill server (rank-0 endpoint) -> its rank 0's handshake
        self._asked: dict[str, list[_Room]] = {}  # prefill server -> rooms waiting for its LAYOUT
        self.moved_bytes = 0  # landed in the pool (transfer.KVTransferBackend.moved_bytes)
        self.peak_staged_bytes = 0  # each message lands as it arrives: nothing staged
        self._dealers: dict[str, zmq.Socket] = {}  # I/O thread only
        self._monitors: dict[str, zmq.Socket] = {}
        self.io = IOLoop("hicache-kv-decode")
        self.io.start()

    # ---- scheduler thread ------------------------------------------------------------------------

    def receiver(self, bootstrap: Bootstrap) -> ZmqKVReceiver:
        return ZmqKVReceiver(self, _Room(bootstrap.room, f"tcp://{bootstrap.host}:{bootstrap.port}"))

    def start(self, state: _Room, slots: torch.Tensor, meta: DecodeMetadata) -> None:
        with self.lock:
            if state.status is not KVPoll.BOOTSTRAPPING:
                return
            if meta.room in self._rooms:
                self.fail(state, f"bootstrap room {meta.room} is already in use on this decode server")
                return
            state.meta, state.slots = meta, slots
            state.status, state.deadline = KVPoll.WAITING_FOR_INPUT, time.monotonic() + self.timeout_s
            self._rooms[meta.room] = state
            layout = self._layouts.get(state.server)
            if layout is not None:
                endpoints = self._open(state, layout)
            else:  # ask the server its topology, once for every request waiting on the answer
                waiting = [s for s in self._asked.get(state.server, []) if s.status is KVPoll.WAITING_FOR_INPUT]
                self._asked[state.server] = [*waiting, state]
                endpoints = [] if waiting else [state.server]
        header = wire.metadata_header(meta, self.timeout_s / 4) if layout is not None else {"room": 0}
        message = wire.encode(wire.META if layout is not None else wire.HELLO, header)
        for endpoint in endpoints:
            self.io.call(lambda endpoint=endpoint: self._dealer(endpoint).send_multipart(message))

    def _open(self, state: _Room, layout: Handshake) -> list[str]:
        """Lock held: the request's sources on the prefill server whose rank 0 has `layout`, and the
        endpoints to send its metadata to (none if the pair is refused: the request fails)."""
        assert state.meta is not None
        problem = layout.mismatch(self.handshake) or cells.misaligned(layout, self.handshake)
        if problem is not None:
            self.fail(state, f"cannot take KV from the prefill server at {state.server}: {problem}")
            return []
        host, port = state.server.rsplit(":", 1)
        ranks = cells.everyone(layout)
        for rank, shared in cells.peers(self.handshake, layout).items():
            draft = cells.sends_draft(ranks[rank], self.handshake)
            cuts = cells.cuts(self.handshake, shared, draft)
            source = _Source(cuts, state.meta.decode_prefix_len, sharded=layout.page_shards > 1)
            state.sources[f"{host}:{int(port) + rank}"] = source
        return list(state.sources)

    def abort(self, state: _Room, reason: str) -> None:
        with self.lock:  # no landing is in progress while this is held
            if state.status in (KVPoll.FAILED, KVPoll.SUCCESS):
                return
            self.fail(state, reason)
            endpoints = state.endpoints
        # Even before any metadata was sent: prefill may hold the request, waiting for it.
        message = wire.encode(wire.ABORT, {"room": state.room, "reason": reason})
        for endpoint in endpoints:
            self.io.call(lambda endpoint=endpoint: self._dealer(endpoint).send_multipart(message))

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
                    self._layouts.pop(endpoint, None)  # a server restarted there may have another topology
                    lost = [s for s in self._rooms.values() if endpoint in s.endpoints]
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
            reply = self._on_message(endpoint, kind, header, payload)
            if reply is not None:
                sock.send_multipart(reply)

    def _on_message(
        self, endpoint: str, kind: bytes, header: dict[str, Any], payload: list[memoryview]
    ) -> list[bytes] | None:
        """Apply one message from the prefill rank at `endpoint`; the reply to send back, if any."""
        if kind == wire.LAYOUT:
            self._on_layout(endpoint, header)
            return None
        room = header["room"]
        with self.lock:
            state = self._rooms.get(room)
            if state is None:
                return None  # aborted, failed or finished here: late messages are dropped
            assert state.meta is not None and state.slots is not None
            try:
                if kind == wire.ERROR:
                    self.fail(state, f"prefill failed the request: {header.get('reason', 'no reason given')}")
                    return None
                source = state.sources.get(endpoint)
                if source is None:
                    raise ValueError("not a prefill rank this request takes KV from")
                if kind == wire.KV:
                    pages = header.get("pages")
                    held = None if pages is None else [int(q) for q in pages]
                    self._land(state, source, int(header["start"]), int(header["end"]), held, payload)
                    return None
                if kind == wire.WORKING:  # prefill is alive and on it: wait the timeout from now
                    state.deadline = time.monotonic() + self.timeout_s
                    return None
                if kind == wire.DONE:
                    if int(header.get("end", -1)) != state.meta.prompt_len or source.next != state.meta.prompt_len:
                        raise ValueError(f"done at token {source.next} of {state.meta.prompt_len}")
                    source.done, state.result = True, wire.parse_result(header)
                    if all(s.done for s in state.sources.values()):
                        self._check_covered(state)
                        state.status = KVPoll.SUCCESS
                        del self._rooms[room]
                    return wire.encode(wire.ACK, {"room": room})
                return None
            except (ValueError, KeyError, TypeError) as exc:
                reason = f"a bad KV message from {endpoint}: {exc}"
                self.fail(state, reason)
                return wire.encode(wire.ABORT, {"room": room, "reason": reason})

    def _on_layout(self, server: str, header: dict[str, Any]) -> None:
        """The prefill server's topology: send the metadata of every request waiting for it."""
        layout: Handshake | None = None
        problem = ""
        try:
            layout = Handshake.from_json(header["handshake"])
        except (KeyError, ValueError) as exc:
            problem = f"the prefill server at {server} sent an unreadable layout: {exc}"
        with self.lock:
            if layout is not None:
                self._layouts[server] = layout
            sends = []
            for state in self._asked.pop(server, []):
                if state.status is not KVPoll.WAITING_FOR_INPUT or self._rooms.get(state.room) is not state:
                    continue
                if layout is None:
                    self.fail(state, problem)
                    continue
                assert state.meta is not None
                message = wire.encode(wire.META, wire.metadata_header(state.meta, self.timeout_s / 4))
                sends += [(endpoint, message) for endpoint in self._open(state, layout)]
        for endpoint, message in sends:
            self._dealer(endpoint).send_multipart(message)

    def _land(
        self, state: _Room, source: _Source, start: int, end: int, held: list[int] | None, payload: list[memoryview]
    ) -> None:
        """Lock held. `held`: the pages a page-sharded source sent rows of. Raises ValueError for a message
        out of order or outside the prompt, or a page sent twice or by a source that holds every page."""
        assert state.meta is not None and state.slots is not None
        if start != source.next or not start < end <= state.meta.prompt_len:
            raise ValueError(f"rows [{start}, {end}) when token {source.next} was expected")
        base = state.meta.decode_prefix_len
        if held is None:
            if source.sharded:
                raise ValueError("rows of a page-sharded prefill rank without the pages they belong to")
            slots = state.slots[start - base : end - base]
        else:
            p = self.handshake.page_size
            seen = state.landed.setdefault(source.cuts, set())
            chunk = range(start // p, -(-end // p))
            if not source.sharded or any(q not in chunk for q in held) or len(set(held)) < len(held):
                raise ValueError(f"pages {held} are not pages of rows [{start}, {end}) this rank may send")
            twice = seen.intersection(held)
            if twice:
                raise ValueError(f"pages {sorted(twice)} came from two prefill ranks: each page has one owner")
            seen.update(held)
            slots = state.slots[tokens_of(held, start, end, p) - base]
        self.moved_bytes += land(self.buffers, slots, payload, source.cuts, self.pool.owned(slots),
                                 self.pool.layer_rows)
        source.next = end
        state.status = KVPoll.TRANSFERRING
        state.deadline = time.monotonic() + self.timeout_s

    def _check_covered(self, state: _Room) -> None:
        """Lock held, every source done: raises ValueError unless the page-sharded sources of each cell
        sent every page of the transfer (between them, once each)."""
        assert state.meta is not None
        p = self.handshake.page_size
        wanted = set(range(state.meta.decode_prefix_len // p, -(-state.meta.prompt_len // p)))
        for cuts in {s.cuts for s in state.sources.values() if s.sharded}:
            missing = wanted - state.landed.get(cuts, set())
            if missing:
                raise ValueError(f"no prefill rank sent pages {sorted(missing)[:8]} of the prompt")
