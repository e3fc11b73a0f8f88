"""The cache-aware router's view of its servers' caches (docs/DESIGN.md, "router"): one KV events
subscriber per server (hicache/events/subscriber.py), fed by a thread of its own.

The thread asks each server for what it holds at start (a replay: a hicache server answers with its
state), then applies every batch as it arrives; a gap or a restarted server makes the subscriber ask
again. Nothing here ever blocks a request: the event loop only reads the indexes (`prefix_tiers`: dict
and set membership, one C-level operation each under the GIL, while the thread adds and removes pages).
A read between two batches, a lost message, a replay that did not come, an endpoint that is down: each
leaves an index stale or empty, which costs a worse choice of server, never a wrong answer (a server
matches a prompt against its own tree).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from hicache.events import KVEventSubscriber
from hicache.router.upstreams import Upstream

logger = logging.getLogger(__name__)

POLL_S = 0.01  # the longest a batch waits before the router applies it
REPLAY_TIMEOUT_S = 1.0  # a replay that does not come holds up the other servers' events this long


class CacheView:
    def __init__(self, servers: Sequence[Upstream]) -> None:
        """Subscribes to every server in `servers` that publishes KV events; the others stay empty."""
        self._subscribers = {
            s.url: KVEventSubscriber(s.kv_events_endpoint, REPLAY_TIMEOUT_S)
            for s in servers
            if s.kv_events_endpoint is not None
        }
        for server in servers:
            if server.kv_events_endpoint is None:
                logger.warning("%s publishes no KV events (--kv-events-endpoint): routed by load alone", server.url)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-kv-events", daemon=True)
        self._thread.start()

    def page_size(self, server: Upstream) -> int | None:
        """The page size `server` names its pages by: its own word, or its events' (None: not known yet)."""
        subscriber = self._subscribers.get(server.url)
        return server.page_size or (subscriber.index.block_size if subscriber is not None else None)

    def prefix_tiers(self, server: Upstream, hashes: Sequence[bytes]) -> list[str]:
        """The tier of each leading page of `hashes` that `server` holds, as its events last said."""
        subscriber = self._subscribers.get(server.url)
        return [] if subscriber is None else subscriber.index.prefix_tiers(hashes)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()
        for subscriber in self._subscribers.values():
            subscriber.close()

    def _run(self) -> None:
        for subscriber in self._subscribers.values():
            self._step(subscriber.catch_up, subscriber)  # what each holds already: it may have served before
        while not self._stopped.wait(POLL_S):
            for subscriber in self._subscribers.values():
                self._step(subscriber.poll, subscriber)

    @staticmethod
    def _step(action: Callable[[], object], subscriber: KVEventSubscriber) -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - one bad message or server must not end the others' events
            # Logged and left stale: the next batch's gap asks for a replay again.
            logger.warning("KV events from %s: %s: %s", subscriber.endpoint, type(exc).__name__, exc)
