"""The hierarchical cache (docs/DESIGN.md, "tiers"): the radix prefix cache over the device tier, with the
host tier (host_tier.py) behind it and, when a backend is configured, the storage tier
(storage_tier.py) below that. This module only wires them into the prefix cache's hooks and runs the
one agreement per scheduler check that every asynchronous result of either tier passes through.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from hicache.cache.api import KVHandle
from hicache.cache.failed_loads import FailedLoads, IssuedLoad
from hicache.cache.host_tier import HostTier, WritePolicy, host_pool_pages
from hicache.cache.prefix_cache import NO_PAGES, PrefixCache
from hicache.cache.radix import MatchResult, TreeNode
from hicache.cache.restores import Restores
from hicache.cache.stats import CacheStats, WorkerStats
from hicache.cache.storage_tier import StorageTier
from hicache.cache.stores import UnifiedPlacement, open_store
from hicache.config import DebugConfig, HiCacheConfig
from hicache.debug.consensus_checker import consensus_checked
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_group import DraftPools, make_host_pool
from hicache.parallel.consensus import Consensus

logger = logging.getLogger(__name__)


class HierarchicalCache(PrefixCache):
    def __init__(
        self,
        pool: DeviceKVPool,
        cfg: HiCacheConfig,
        consensus: Consensus,
        model_identity: str,
        rank_suffix: str = "",
        debug: DebugConfig | None = None,
        draft: DraftPools | None = None,
        storage_writer: bool = True,  # this rank writes its pages to storage (not a replica of them)
        unified: UnifiedPlacement | None = None,  # --hicache-storage-key-scheme unified: the rank's shard
    ) -> None:
        """`draft`: a speculative draft whose state the host and storage tiers keep with the target's."""
        debug = debug or DebugConfig()
        host_pool = make_host_pool(
            pool, host_pool_pages(pool, cfg, draft), cfg.hicache_mem_layout, draft, cfg.hicache_storage_head_partition or 1
        )
        super().__init__(pool, enabled=True, on_host_free=host_pool.allocator.free, draft=draft is not None)
        self.skip_draft_restore = draft is not None and draft.skip_restore
        self.consensus = consensus
        delay = debug.debug_transfer_delay_ms / 1000
        policy = WritePolicy(cfg.hicache_write_policy)
        self.host = HostTier(
            pool, host_pool, self.tree, consensus, policy, cfg.hicache_load_back_threshold, delay,
            cfg.hicache_transfer_timeout, debug.debug_load_fail_rate,
        )  # fmt: skip
        self.restores = Restores(self.host.ledger, consensus)
        self.storage: StorageTier | None = None
        if cfg.hicache_storage_backend:
            rank = consensus.pctx.rank
            page_bytes = host_pool.parts[0].payload_bytes
            store = open_store(
                cfg, pool, page_bytes, model_identity, rank_suffix, debug, rank, unified, storage_writer
            )
            self.storage = StorageTier(store, self.host, consensus, cfg, delay, writes=storage_writer)
        logger.info(
            "hierarchical cache: host %d pages (%.2f GB, %s), write policy %s, storage %s",
            host_pool.allocator.num_pages, host_pool.allocator.num_pages * host_pool.page_bytes / 1e9,
            cfg.hicache_mem_layout, policy.value, cfg.hicache_storage_backend or "none",
        )  # fmt: skip

    # ---- the prefix cache's hooks --------------------------------------------------------------

    def _on_open(self, handle: KVHandle) -> None:
        if self.storage is not None:
            self.storage.start_prefetch(handle.rid, handle.prompt, handle.namespace)

    @consensus_checked(params={"rid": "handle.rid", "busy": "busy"}, results=("result",))
    def ready_to_admit(self, handle: KVHandle, busy: bool) -> bool:
        return self.storage is None or self.storage.ready_to_admit(handle.rid, busy)

    def _fetched(self, handle: KVHandle) -> range:
        if self.storage is None:
            return NO_PAGES
        return self.storage.consume(handle.rid, handle.prompt, handle.namespace).pages

    def _load_back(self, match: MatchResult, budget: int) -> IssuedLoad | None:
        return self.host.load_back(match, budget, self.alloc)

    def _on_admitted(self, handle: KVHandle) -> None:
        assert handle.lock is not None
        path = self.tree.path_to_root(handle.lock)
        self.host.on_hit(path)
        if self.storage is not None:
            self.storage.puts.retry(path)

    def _on_new_nodes(self, nodes: list[TreeNode]) -> None:
        self.host.on_new_nodes(nodes)

    def _keep_on_evict(self, node: TreeNode) -> bool:
        if not self.host.write_back(node):
            return False
        self._put([node])
        return True

    def _on_release(self, handle: KVHandle) -> None:
        if self.storage is not None:
            self.storage.cancel(handle.rid)

    def _draft_unrestored(self, handle: KVHandle) -> int:
        # Loads skipped the draft's layers (a negative control): it recomputes what came from host.
        return handle.cached.host + handle.cached.storage if self.skip_draft_restore else 0

    def _put(self, nodes: list[TreeNode]) -> None:
        if self.storage is not None:
            self.storage.puts.put(nodes)

    def before_layer(self) -> Callable[[int], None] | None:
        return self.host.before_layer()

    @consensus_checked(params=(), results={"pages": lambda ns: sorted(ns["result"].pages)})
    def failed_loads(self) -> FailedLoads:
        return self.host.settle_loads()

    def drop_failed_loads(self, failed: FailedLoads, requests: int) -> None:
        # Not only the failed loads' pages come back: below their nodes hang those of loads that landed
        # in the same step, which cannot be served under a prefix that was never written either.
        taken = self.tree.detach_device(failed.holders)
        self.device.free(self.host.ledger.hold_still_copying(failed, taken))
        self.host.stats.load_failed_requests += requests

    def check(self) -> None:
        # One agreement per check, on every rank, even when every queue is empty.
        querying = self.storage.querying() if self.storage is not None else []
        queried = [int(p.query.done.is_set()) for p in querying]  # type: ignore[union-attr]
        backups, loads, *queries = self.consensus.agree_min("transfer_acks", [*self.host.acks_ready(), *queried])
        self._put(self.host.consume_acks(backups, loads))
        if self.storage is not None:
            self.storage.advance([p for p, ok in zip(querying, queries) if ok])

    # ---- maintenance ---------------------------------------------------------------------------

    def _drain(self) -> None:
        for finished in self.host.drain():
            self._put(finished)

    def flush(self) -> None:
        self._drain()
        self.device.evict_all()
        self.host.evict_all()
        self.tree.reset()

    def leak_report(self) -> list[str]:
        problems = super().leak_report() + self.host.leak_report()
        return problems + (self.storage.leak_report() if self.storage is not None else [])

    def usage(self) -> dict[str, tuple[int, int]]:
        return {**super().usage(), "host": self.host.usage()}

    def resident_bytes(self) -> dict[str, int]:
        return {**super().resident_bytes(), "host": self.host.host.resident_bytes()}

    def stats(self) -> CacheStats:
        workers = self.host.workers + ([self.storage.worker] if self.storage is not None else [])
        return CacheStats(
            host=dataclasses.replace(self.host.stats),
            storage=self.storage.snapshot() if self.storage is not None else None,
            workers=WorkerStats(sum(w.restarts for w in workers), sum(w.failures for w in workers)),
        )

    def checked_parts(self) -> list[object]:
        return super().checked_parts() + [self.host] + ([self.storage] if self.storage is not None else [])

    def shutdown(self) -> None:
        self._drain()
        self.host.shutdown()
        if self.storage is not None:
            self.storage.shutdown()
        self.consensus.flush()
