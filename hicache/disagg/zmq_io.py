"""P/D disaggregation: the I/O thread of the ZeroMQ transport (zmq_prefill.py, zmq_decode.py).

ZeroMQ sockets are not thread-safe, so each backend's sockets live on one thread of its own, which
polls them together with a wake-up socket pair; the scheduler thread hands it work as closures
(`call`). The thread is supervised: an exception in a handler is logged and the loop goes on (the
handler fails what it was working on), so one bad message never ends the transport.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable

import zmq

from hicache.parallel.threads import serial_kernels

logger = logging.getLogger(__name__)

POLL_MS = 50  # how often `tick` runs when nothing arrives


class IOLoop:
    def __init__(self, name: str, tick: Callable[[], None] | None = None) -> None:
        self.ctx = zmq.Context()
        self.name = name
        self._tick = tick
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._handlers: dict[object, Callable[[], None]] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread soon (any thread may call this)."""
        if self._stopped.is_set():
            return
        self._commands.put(fn)
        try:
            self._wake_w.send(b"\0")
        except OSError:  # closed by a concurrent stop; nothing will run it anyway
            pass

    def watch(self, sock: zmq.Socket, on_readable: Callable[[], None]) -> None:
        """I/O thread (or before `start`): call `on_readable` whenever `sock` has a message."""
        self._poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = on_readable

    def unwatch(self, sock: zmq.Socket) -> None:
        self._poller.unregister(sock)
        self._handlers.pop(sock, None)

    def _run(self) -> None:
        serial_kernels()
        while not self._stopped.is_set():
            try:
                ready = dict(self._poller.poll(POLL_MS))
                if self._wake_r.fileno() in ready or self._wake_r in ready:
                    self._drain_wakeups()
                    # Only the commands queued so far: one that queues its sequel (a transfer's next
                    # chunk) lets the sockets be read in between, so an abort is seen mid-transfer.
                    for _ in range(self._commands.qsize()):
                        self._commands.get()()
                for sock, handler in list(self._handlers.items()):
                    if sock in ready:
                        handler()
                if self._tick is not None:
                    self._tick()
            except Exception:
                if self._stopped.is_set():
                    break
                logger.exception("%s: a transfer step failed; the loop goes on", self.name)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def stop(self, close: Callable[[], None]) -> None:
        """Stop the thread, run `close` (the backend fails what is in flight), close every socket."""
        self._stopped.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        close()
        self.ctx.destroy(linger=0)  # closes every socket still open
        self._wake_r.close()
        self._wake_w.close()
