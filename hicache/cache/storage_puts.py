"""The storage tier's puts (docs/DESIGN.md, "tiers"): a node backed up to the host is queued for storage
(batched, on the storage worker) under its chained page hashes; pages the store already holds are not
written again (content addressing: another server, or an earlier run, may have written them).

A put that finds the store unavailable (a Redis restart, a full disk) is not lost for good: the worker
hands back its page hashes, remembered here (`unstored`, at most as many as the host pool has pages:
beyond that the oldest can have no host copy left), and put again from the host copy while it lasts:
when a request reuses them (at once if the store answered its last call, else at most once a second, a
try that is also the probe that finds out), and at shutdown. Otherwise a prefix every request shares,
first written during an outage, would never reach storage: its node stays in host and is never put
again, and every lookup after the outage misses at its first page.

Each rank puts only its own pages (`HostKVPool.owns`), and only if it is the elected writer of their
bytes (`writes`); with a speculative draft every page is put once per part (the target's and the
draft's objects together). Retries are this rank's alone: no agreement, the tree does not change.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from hicache.cache.controller import Clock, TransferOp, Worker
from hicache.cache.host_tier import HostTier
from hicache.cache.kv_events import STORAGE
from hicache.cache.radix import TreeNode
from hicache.cache.stats import StorageTierStats
from hicache.cache.tree_node import chain_hashes
from hicache.mem.host_pool import PagePart
from hicache.storage import VerifiedStore

RETRY_PROBE_INTERVAL_S = 1.0  # while the store is down, how often a retried put may find out it is back
# A retention without an end (until evicted) as a store's time credit: after every page used within a year.
UNTIL_EVICTED_S = 365 * 24 * 3600.0

Uses = Sequence[tuple[list[bytes], float | None]]  # page hashes a put marks used, and when (StoragePuts._uses)


class StoragePuts:
    def __init__(
        self,
        parts: Sequence[tuple[VerifiedStore, PagePart]],
        host: HostTier,
        worker: Worker,
        stats: StorageTierStats,
        writes: bool,
        clock: Clock = time.monotonic,
    ) -> None:
        """`parts`: (store, host part) per object of a page, the target's first; `writes`: this rank is
        the elected writer of its pages' bytes (not a replica's); `clock`: what the retry interval reads."""
        self.parts = list(parts)
        self.pool = host.host
        self.tree = host.tree
        self.page_size = host.pool.page_size
        self.worker = worker
        self.stats = stats
        self.writes = writes
        self.clock = clock
        # Hashes of pages whose put failed: appended by the worker, taken in by the scheduler.
        self._failed: deque[list[bytes]] = deque()
        self.unstored: dict[bytes, None] = {}  # insertion-ordered: the oldest is dropped first
        self._last_retry = 0.0

    def put(self, nodes: list[TreeNode]) -> TransferOp | None:
        """Queue the host copies of `nodes` for storage (the put, to wait for; None: nothing to put; called
        every step, with no nodes too, so what the store's cap evicted is reported within a step). The
        pages of their ancestors are touched after it: a store that evicts the least recently used then
        takes a chain from its tail, not its head, which a hit in memory never reads there. Retained
        pages, theirs and the ancestors', are touched at the end of their retention (`_uses`)."""
        self._report_evicted()
        pages = [(digest, page) for node in nodes for _, digest, page in self._own_pages(node)]
        for node in nodes:  # the whole page, as every owner puts its part of it
            self.tree.events.stored(node, STORAGE)
        self.stats.put_pages += len(pages)
        return self._submit(pages, self._uses(nodes) if pages else [])

    def retry(self, path: list[TreeNode]) -> TransferOp | None:
        """Put again the pages of `path` (a request's matched prefix) whose put found the store
        unavailable (the put; None: nothing to retry, or the store is down and was tried just now)."""
        self._take_in_failed()
        if not self.unstored:
            return None
        now = self.clock()
        if not self.parts[0][0].available and now - self._last_retry < RETRY_PROBE_INTERVAL_S:
            return None
        self._last_retry = now
        pages = self._unstored_pages(path, report=True)
        self.stats.put_retried_pages += len(pages)
        return self._submit(pages)

    def put_unstored(self) -> None:
        """At shutdown, on the calling thread, after the worker has stopped: put what an outage kept
        out while the host still has it, so a server started after a store restart finds it."""
        self._take_in_failed()
        if self.unstored and (last := self._op(self._unstored_pages(self.tree.nodes()))) is not None:
            last.run(last)

    def _own_pages(self, node: TreeNode) -> Iterator[tuple[int, bytes, int]]:
        """(its number in the node, hash, host page) of the node's pages this rank writes: its own, once
        per distinct copy."""
        if not self.writes:
            return
        for number, (digest, page) in enumerate(zip(chain_hashes(node, self.page_size), node.host_pages or [])):
            if self.pool.owns(page):
                yield number, digest, page

    def _unstored_pages(self, nodes: Iterable[TreeNode], report: bool = False) -> list[tuple[bytes, int]]:
        """This rank's pages of `nodes` whose put failed, taken out of `unstored` (a retry that fails
        too comes back in); `report`: recorded as stored again (the retry's put)."""
        pages = []
        for node in nodes:
            if node.hashes is None or not node.backed_up:  # never put: a put needs both
                continue
            retried = []
            for number, digest, page in self._own_pages(node):
                if digest in self.unstored:
                    del self.unstored[digest]
                    pages.append((digest, page))
                    retried.append(number)
            if report and retried:
                self.tree.events.stored(node, STORAGE, retried)
        return pages

    def _uses(self, nodes: list[TreeNode]) -> list[tuple[list[bytes], float | None]]:
        """What a put of `nodes` marks used, and when (wall-clock seconds; None: now): the pages of the
        nodes above them (none of them), root first, which the put leans on; and every retained page of
        both at the end of its retention, a time credit for a store that keeps no priorities
        (docs/DESIGN.md, "retention hints"; a store never moves a use back, so the order does not matter)."""
        seen = {id(node) for node in nodes}
        above: list[TreeNode] = []
        for node in nodes:
            chain, up = [], node.parent
            while up is not None and up.parent is not None and id(up) not in seen:  # not the root
                seen.add(id(up))
                chain.append(up)
                up = up.parent
            above += reversed(chain)
        now, plain = time.time(), []
        uses: list[tuple[list[bytes], float | None]] = [(plain, None)]
        for node, leant_on in [(node, True) for node in above] + [(node, False) for node in nodes]:
            if left := self.tree.retention.remaining(node):  # once a node: a put walks a whole history
                uses.append((chain_hashes(node, self.page_size), now + min(left, UNTIL_EVICTED_S)))
            elif leant_on:
                plain += chain_hashes(node, self.page_size)
        return uses

    def _report_evicted(self) -> None:
        """KV events for the pages a store's own cap evicted (the file store's, during this rank's puts):
        a page any of whose objects went is gone from storage."""
        backends = {id(store.backend): store.backend for store, _ in self.parts}
        keys = [key for backend in backends.values() for key in backend.take_evicted()]
        if keys:
            pages = dict.fromkeys(page for store, _ in self.parts for page in store.pages_of(keys))
            self.tree.events.removed_pages(list(pages), STORAGE)

    def _take_in_failed(self) -> None:
        while self._failed:
            hashes = self._failed.popleft()
            self.stats.put_failed_pages += len(hashes)
            self.tree.events.removed_pages(hashes, STORAGE)
            self.unstored.update(dict.fromkeys(hashes))
        for _ in range(len(self.unstored) - self.pool.allocator.num_pages):
            del self.unstored[next(iter(self.unstored))]

    def _submit(self, pages: list[tuple[bytes, int]], uses: Uses = ()) -> TransferOp | None:
        return None if (op := self._op(pages, uses)) is None else self.worker.submit(op)

    def _op(self, pages: list[tuple[bytes, int]], uses: Uses = ()) -> TransferOp | None:
        if not pages:
            return None
        hashes = [digest for digest, _ in pages]
        # A copy now: the host pages may be evicted and reused before the put runs.
        payloads = [[part.payload(page) for _, page in pages] for _, part in self.parts]
        parts, failed = self.parts, self._failed

        def run(_: TransferOp) -> None:
            stored = True
            for (store, _), part_payloads in zip(parts, payloads):
                present = store.exists_prefix(hashes)
                stored &= store.put_pages(hashes[present:], part_payloads[present:])
                for used, at in uses:
                    if used:
                        store.touch(used, at)
            if not stored:
                failed.append(hashes)

        return TransferOp("storage_put", run, pages=len(pages))
