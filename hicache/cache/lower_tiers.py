"""The tiers below the device (docs/DESIGN.md, "tiers"): the host tier (host_tier.py) and, when a
storage backend is configured, the storage tier (storage_tier.py) under it. The prefix cache holds one
`LowerTiers` when the hierarchical cache is on and asks it at each point of a handle's life where a
lower tier takes part (what only the host tier does, loading back and backing up new nodes, it asks
`host` for directly); this module routes each to the tier concerned and runs the one agreement per
scheduler check that every asynchronous result of either tier passes through. The optional storage
tier is asked only here.
"""

from __future__ import annotations

import dataclasses

from hicache.cache.api import KVHandle
from hicache.cache.failed_loads import FailedLoads
from hicache.cache.host_tier import HostTier
from hicache.cache.radix import TreeNode
from hicache.cache.stats import CacheStats, WorkerStats
from hicache.cache.storage_tier import StorageTier
from hicache.parallel.consensus import Consensus

NO_PAGES = range(0)


class LowerTiers:
    def __init__(self, host: HostTier, storage: StorageTier | None, consensus: Consensus) -> None:
        self.host = host
        self.storage = storage
        self.consensus = consensus
        self.tree = host.tree
        # What every lower tier answers alike (leaks, workers, checked decisions, shutdown).
        self.tiers: list[HostTier | StorageTier] = [host] + ([storage] if storage is not None else [])

    # ---- a handle's life -----------------------------------------------------------------------

    def open(self, handle: KVHandle) -> None:
        """A request arrived: a storage tier starts its prefetch."""
        if self.storage is not None:
            self.storage.start_prefetch(handle.rid, handle.packed_prompt, handle.namespace)

    def ready_to_admit(self, handle: KVHandle, busy: bool) -> bool:
        return self.storage is None or self.storage.ready_to_admit(handle.rid, busy)

    def fetched(self, handle: KVHandle) -> range:
        """Just before matching: prompt pages a storage prefetch has put on the host for this request."""
        if self.storage is None:
            return NO_PAGES
        return self.storage.consume(handle.rid, handle.prompt, handle.namespace).pages

    def on_admitted(self, handle: KVHandle) -> None:
        """The handle is READY, its prefix locked: selective write-through backs up hot nodes, and puts
        that found the store down are tried again."""
        assert handle.lock is not None
        path = self.tree.path_to_root(handle.lock)
        self.host.on_hit(path)
        if self.storage is not None:
            self.storage.puts.retry(path)

    def keep_on_evict(self, node: TreeNode) -> bool:
        """A node leaving the device without a host copy: True if write-back copied it now."""
        if not self.host.write_back(node):
            return False
        self._put([node])
        return True

    def on_release(self, handle: KVHandle) -> None:
        """The request went away: a prefetch still running for it is cancelled."""
        if self.storage is not None:
            self.storage.cancel(handle.rid)

    def _put(self, nodes: list[TreeNode]) -> None:
        if self.storage is not None:
            self.storage.puts.put(nodes)

    # ---- asynchronous results ------------------------------------------------------------------

    def check(self) -> None:
        # One agreement per check, on every rank, even when every queue is empty.
        querying = self.storage.querying() if self.storage is not None else []
        queried = [int(p.query.done.is_set()) for p in querying]  # type: ignore[union-attr]
        backups, loads, *queries = self.consensus.agree_min("transfer_acks", [*self.host.acks_ready(), *queried])
        self._put(self.host.consume_acks(backups, loads))
        if querying:
            self.storage.advance([p for p, ok in zip(querying, queries) if ok])  # type: ignore[union-attr]

    def drop_failed_loads(self, failed: FailedLoads, requests: int) -> None:
        # Not only the failed loads' pages come back: below their nodes hang those of loads that landed
        # in the same step, which cannot be served under a prefix that was never written either.
        taken = self.tree.detach_device(failed.holders)
        self.host.pool.free(self.host.ledger.hold_still_copying(failed, taken))
        self.host.stats.load_failed_requests += requests

    # ---- maintenance ---------------------------------------------------------------------------

    def drain(self) -> None:
        for finished in self.host.drain():
            self._put(finished)

    def leak_report(self) -> list[str]:
        return [problem for tier in self.tiers for problem in tier.leak_report()]

    def stats(self) -> CacheStats:
        workers = [worker for tier in self.tiers for worker in tier.workers]
        return CacheStats(
            host=dataclasses.replace(self.host.stats),
            storage=self.storage.snapshot() if self.storage is not None else None,
            workers=WorkerStats(sum(w.restarts for w in workers), sum(w.failures for w in workers)),
        )

    def checked_parts(self) -> list[object]:
        return list(self.tiers)

    def shutdown(self) -> None:
        self.drain()
        for tier in self.tiers:
            tier.shutdown()
        self.consensus.flush()
