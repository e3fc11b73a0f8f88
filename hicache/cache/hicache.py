"""The hierarchical cache: the device radix cache plus a host-memory tier and a storage tier.

- Write policies decide when a device node is backed up to the host: at creation (write_through),
  at its second hit (write_through_selective), or when it is evicted from the device (write_back).
  A backup locks its node until its ACK is consumed; a consumed backup also queues the pages for
  storage (batched, on the storage worker).
- Load-back: a match that continues into host-only nodes gets device pages for all of them (all or
  nothing; hits under --hicache-load-back-threshold tokens are recomputed instead), evicting device
  cache first if needed; the copy runs layer by layer so the forward pass of layer i waits only for
  layer i.
- Prefetch: on arrival, the part of a prompt beyond the tree's match is looked up in storage; if at
  least --hicache-storage-prefetch-threshold tokens are there, host pages are taken (only then) and
  the pages are read in the background. At admission the agreed-on completed prefix is inserted into
  the tree as host-only nodes and loaded back like any host hit. Every page lost on the way gets a
  reason code (see `PrefetchLoss`).
- Every consumption of a completed transfer goes through `Consensus` (identity at one rank): ranks
  agree on how many ACKs to consume, then fold the identities of what they consumed into the chain the
  next agreement compares. Storage threads agree (MIN over every rank) on the hit length before
  reading and on the pages read after each batch, and publish that agreed progress in order; the
  scheduler consumes the number of progress entries the first stage chose.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from hicache.cache.controller import AckQueue, CopyStream, SupervisedWorker, TransferOp
from hicache.cache.prefix_cache import ADMIT_PARAMS, ADMIT_RESULTS, RELEASE_PARAMS, PrefixCache
from hicache.cache.radix import MatchResult, TreeNode
from hicache.config import DebugConfig, HiCacheConfig
from hicache.debug.consensus_checker import consensus_checked
from hicache.debug.faults import FlakyReads
from hicache.dist.consensus import Consensus
from hicache.engine.request import Request
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_pool import HostKVPool
from hicache.storage import Namespace, VerifiedStore, make_backend, page_hashes

logger = logging.getLogger(__name__)

PREFETCH_BATCH_PAGES = 8  # pages per storage read call: the unit at which a prefetch can be stopped


class PrefetchLoss(str, enum.Enum):
    """Why a page found in storage did not end up serving a request."""

    BELOW_THRESHOLD = "below_threshold"  # too few pages in storage to be worth a prefetch
    HOST_FULL = "host_full"  # no host memory for it, even after host eviction
    READ_FAILED = "read_failed"  # missing, corrupt or unreadable when read (storage metrics say which)
    NOT_READ_IN_TIME = "not_read_in_time"  # the policy stopped waiting before it was read
    ALREADY_CACHED = "already_cached"  # the tree got it from elsewhere meanwhile
    PREFIX_EVICTED = "prefix_evicted"  # the cached prefix it continues was evicted meanwhile
    CANCELLED = "cancelled"  # the request went away


@dataclass(eq=False)
class Prefetch:
    """Lifecycle: queried -> allocated -> read -> inserted."""

    req: Request
    hashes: list[bytes]  # of the pages to look up (after the tree's match)
    start_page: int  # index of hashes[0] in the prompt
    started: float = field(default_factory=time.monotonic)
    query: TransferOp | None = None
    hit_pages: int = 0
    host_pages: list[int] = field(default_factory=list)
    read: TransferOp | None = None
    # Leading pages read and verified on every rank, one entry per agreed batch, in order (written by
    # the storage worker): the ordered ACK queue of the read.
    progress: list[int] = field(default_factory=list)
    consume: int = 0  # how many progress entries admission uses (the first stage's choice)
    read_failed: bool = False  # a page was missing, corrupt or unreadable on some rank
    stop: threading.Event = field(default_factory=threading.Event)
    done: bool = False  # nothing more will happen before admission consumes it


class HierarchicalCache(PrefixCache):
    def __init__(
        self,
        pool: DeviceKVPool,
        cfg: HiCacheConfig,
        consensus: Consensus,
        model_identity: str,
        rank_suffix: str = "",
        debug: DebugConfig | None = None,
    ) -> None:
        super().__init__(pool, enabled=True)
        self.cfg = cfg
        self.consensus = consensus
        debug = debug or DebugConfig()
        rank = consensus.pctx.rank
        delay = debug.debug_transfer_delay_ms / 1000
        probe = HostKVPool(pool, 1, cfg.hicache_mem_layout)
        if cfg.hicache_size > 0:
            host_pages = int(cfg.hicache_size * 1e9) // probe.page_bytes
        else:
            host_pages = int(pool.allocator.num_pages * cfg.hicache_ratio)
        del probe
        self.host = HostKVPool(pool, max(host_pages, 1), cfg.hicache_mem_layout)
        self.tree._free_host = self.host.allocator.free
        self.copies = CopyStream(pool.device)
        # Per-rank seeds: the ranks' copies finish in different orders, which is what agreement is for.
        self.backup_worker = SupervisedWorker("backup", delay, seed=rank * 16)
        self.load_worker = SupervisedWorker("load", delay, seed=rank * 16 + 1)
        self.backups = AckQueue()
        self.loads = AckQueue()
        self.counters: Counter[str] = Counter()
        self.store: VerifiedStore | None = None
        self.prefetches: dict[int, Prefetch] = {}
        self.storage_origin: dict[int, tuple[int, int]] = {}  # rid -> [first, end) prompt pages read from storage
        if cfg.hicache_storage_backend:
            namespace = Namespace(
                model=model_identity,
                kv_dtype=str(pool.dtype).removeprefix("torch."),
                page_size=pool.page_size,
                layout=f"page_rows:{pool.layout.row_numel}x{pool.num_layers}",
                rank=rank_suffix,
            )
            backend = make_backend(cfg.hicache_storage_backend, cfg.hicache_storage_dir, cfg.hicache_storage_url)
            if debug.debug_storage_fail_rate > 0 and rank == debug.debug_storage_fail_rank:
                backend = FlakyReads(backend, debug.debug_storage_fail_rate, seed=rank)
                logger.warning(
                    "rank %d fails %.0f%% of storage reads (fault injection)", rank, 100 * debug.debug_storage_fail_rate
                )
            self.store = VerifiedStore(backend, namespace, payload_bytes=self.host.page_bytes)
            self.storage_worker = SupervisedWorker("storage", delay, seed=rank * 16 + 2)
        logger.info(
            "hierarchical cache: host %d pages (%.2f GB, %s), write policy %s, storage %s",
            self.host.allocator.num_pages, self.host.allocator.num_pages * self.host.page_bytes / 1e9,
            cfg.hicache_mem_layout, cfg.hicache_write_policy, cfg.hicache_storage_backend or "none",
        )  # fmt: skip

    # ---- host memory ---------------------------------------------------------------------------

    def _alloc_host(self, n: int) -> list[int] | None:
        short = n - self.host.allocator.free_pages
        if short > 0:
            self.tree.evict_host(short)
        return self.host.allocator.alloc(n)

    # ---- device -> host backups ----------------------------------------------------------------

    def _backup(self, node: TreeNode) -> None:
        if node.host_pages is not None or node.device_pages is None:
            return
        host_pages = self._alloc_host(len(node.device_pages))
        if host_pages is None:
            self.counters["backup_skipped_host_full_pages"] += len(node.device_pages)
            return
        node.host_pages = host_pages
        node.backup_pending = True
        self.tree.lock(node)  # its device pages must stay put while they are copied
        device_pages = list(node.device_pages)
        fence = self.copies.fence()

        def run(_: TransferOp) -> None:
            self.copies.run(fence, lambda: self.host.backup(self.pool, device_pages, host_pages))

        op = TransferOp("backup", run, payload=node)
        op.ident = hash((node.key, device_pages[0], len(device_pages)))
        self.backups.push(op)
        self.backup_worker.submit(op)

    def _on_new_nodes(self, nodes: list[TreeNode]) -> None:
        if self.cfg.hicache_write_policy == "write_through":
            for node in nodes:
                self._backup(node)

    def _keep_on_evict(self, node: TreeNode) -> bool:
        if self.cfg.hicache_write_policy != "write_back" or node.host_pages is not None:
            return False
        host_pages = self._alloc_host(len(node.device_pages or []))
        if host_pages is None:
            self.counters["backup_skipped_host_full_pages"] += len(node.device_pages or [])
            return False
        # Write-back copies at eviction time, synchronously: the device pages are about to be reused.
        device_pages = list(node.device_pages or [])
        self.copies.run(self.copies.fence(), lambda: self.host.backup(self.pool, device_pages, host_pages))
        node.host_pages = host_pages
        self._count_backup(len(host_pages))
        self._queue_storage_put([node])
        return True

    def _count_backup(self, pages: int) -> None:
        self.counters["backup_pages"] += pages
        self.counters["backup_bytes"] += pages * self.host.page_bytes

    def _finish_backup(self, op: TransferOp) -> list[TreeNode]:
        """Apply one acknowledged backup to its node and the nodes a split cut off above it."""
        node: TreeNode = op.payload  # type: ignore[assignment]
        self.tree.unlock(node)
        finished = []
        while node is not None and not node.is_root and node.backup_pending:
            node.backup_pending = False
            if op.failed:
                self.host.allocator.free(node.host_pages or [])
                node.host_pages = None
            else:
                self._count_backup(len(node.host_pages or []))
                finished.append(node)
            node = node.parent  # type: ignore[assignment]
        return finished

    # ---- host -> device loads ------------------------------------------------------------------

    def _load_back(self, req: Request, match: MatchResult, budget: int) -> TreeNode:
        host_pages = match.host_pages
        if not host_pages or len(host_pages) * self.page_size < self.cfg.hicache_load_back_threshold:
            return match.last_device_node
        if len(host_pages) > budget:
            return match.last_device_node
        device_pages = self.alloc(len(host_pages))
        offset = 0
        for node in match.host_nodes:
            k = len(node.host_pages or [])
            self.tree.attach_device(node, device_pages[offset : offset + k])
            offset += k
        layer_done = [threading.Event() for _ in range(self.pool.num_layers)]
        fence = self.copies.fence()

        def run(_: TransferOp) -> None:
            for layer, event in enumerate(layer_done):
                self.copies.run(fence, lambda: self.host.load_layer(self.pool, layer, host_pages, device_pages))
                event.set()

        op = TransferOp("load", run, payload=layer_done)
        op.ident = hash((tuple(n.key for n in match.host_nodes), device_pages[0], len(device_pages)))
        self.loads.push(op)
        self.load_worker.submit(op)
        self.counters["load_pages"] += len(host_pages)
        self.counters["load_bytes"] += len(host_pages) * self.host.page_bytes
        first_page = len(req.pages)
        req.pages.extend(device_pages)
        from_storage = self._storage_pages_within(req, first_page, first_page + len(host_pages))
        req.cached_tokens_by_tier["storage"] += from_storage * self.page_size
        req.cached_tokens_by_tier["host"] += (len(host_pages) - from_storage) * self.page_size
        return match.host_nodes[-1]

    def _storage_pages_within(self, req: Request, first: int, end: int) -> int:
        origin = self.storage_origin.pop(req.rid, None)
        if origin is None:
            return 0
        return max(0, min(end, origin[1]) - max(first, origin[0]))

    def before_layer(self) -> Callable[[int], None] | None:
        pending = self.loads.running()
        if not pending:
            return None

        def wait(layer: int) -> None:
            for op in pending:
                events: list[threading.Event] = op.payload  # type: ignore[assignment]
                while not events[layer].wait(timeout=0.05):
                    if op.done.is_set():
                        break
                if op.failed:
                    raise RuntimeError(f"host -> device load failed: {op.error}")

        return wait

    # ---- storage -------------------------------------------------------------------------------

    def _node_hashes(self, node: TreeNode) -> list[bytes]:
        """Chained storage hashes of a node's pages, computed once per node from its parent's."""
        if node.hashes is None:
            parent = node.parent
            prior = None
            if parent is not None and not parent.is_root:
                prior = self._node_hashes(parent)[-1]
            node.hashes = page_hashes(node.key, self.page_size, prior)
        return node.hashes

    def _queue_storage_put(self, nodes: list[TreeNode]) -> None:
        if self.store is None or not nodes:
            return
        hashes: list[bytes] = []
        payloads: list[bytes] = []
        for node in nodes:
            hashes.extend(self._node_hashes(node))
            # A copy now: the host pages may be evicted and reused before the put runs.
            payloads.extend(self.host.page_payload(p) for p in node.host_pages or [])
        store = self.store

        def run(_: TransferOp) -> None:
            # Content-addressed: what another server (or an earlier run) stored need not be written again.
            present = store.exists_prefix(hashes)
            store.put_pages(hashes[present:], payloads[present:])

        self.storage_worker.submit(TransferOp("storage_put", run))
        self.counters["storage_put_pages"] += len(hashes)

    def on_arrival(self, req: Request) -> None:
        if self.store is None:
            return
        key = req.prompt_ids[: req.prompt_len - 1]
        total = len(key) // self.page_size
        match = self.tree.match_prefix(key, req.namespace)
        start = len(match.device_pages) + len(match.host_pages)
        if (total - start) * self.page_size < max(self.cfg.hicache_storage_prefetch_threshold, 1):
            return
        hashes = page_hashes(key[: total * self.page_size], self.page_size)[start:]
        prefetch = Prefetch(req, hashes, start)
        store, consensus = self.store, self.consensus

        def query(op: TransferOp) -> None:
            try:
                found = store.exists_prefix(hashes)
            except Exception:  # noqa: BLE001 - a miss here; the agreement below must still happen
                logger.exception("storage existence query failed; treated as a miss")
                found = 0
            # MIN over every rank before reading: the common prefix all ranks can load.
            op.payload = consensus.agree_min_all("storage_hit_pages", [found])[0]

        prefetch.query = self.storage_worker.submit(TransferOp("storage_query", query))
        self.prefetches[req.rid] = prefetch
        self.counters["prefetch_queried_pages"] += len(hashes)

    def _querying(self) -> list[Prefetch]:
        """Prefetches whose existence query may have finished (the same list on every rank)."""
        return [p for p in self.prefetches.values() if not p.done and p.read is None and p.query is not None]

    def _advance_prefetches(self, agreed_ready: list[Prefetch]) -> None:
        """Move prefetches whose existence query finished (on the first stage) to reading, taking
        host memory now."""
        for prefetch in agreed_ready:
            assert prefetch.query is not None
            prefetch.query.done.wait()  # finished on the first stage; here it may still be finishing
            hit = 0 if prefetch.query.failed else int(prefetch.query.payload)  # type: ignore[arg-type]
            prefetch.hit_pages = hit
            self.counters["prefetch_hit_pages"] += hit
            if hit * self.page_size < self.cfg.hicache_storage_prefetch_threshold:
                self._lose(PrefetchLoss.BELOW_THRESHOLD, hit)
                prefetch.done = True
                continue
            host_pages = self._alloc_host(hit)
            if host_pages is None:
                self._lose(PrefetchLoss.HOST_FULL, hit)
                prefetch.done = True
                continue
            self.counters["prefetch_allocated_pages"] += hit
            prefetch.host_pages = host_pages
            prefetch.read = self.storage_worker.submit(TransferOp("storage_read", self._read_run(prefetch)))

    def _read_batch(self, prefetch: Prefetch, first: int, last: int) -> int:
        """Read pages [first, last) of the hit into their host pages; how many leading ones verified."""
        store, host = self.store, self.host
        assert store is not None
        pages = prefetch.host_pages[first:last]
        if host.layout == "page_first":
            ok = store.get_pages_into(prefetch.hashes[first:last], [host.page_view(p) for p in pages])
        else:
            payloads = store.get_pages(prefetch.hashes[first:last])
            ok = [p is not None for p in payloads]
            for page, payload in zip(pages, payloads):
                if payload is not None:
                    host.write_page(page, payload)
        return next((i for i, good in enumerate(ok) if not good), len(ok))

    def _read_run(self, prefetch: Prefetch) -> Callable[[TransferOp], None]:
        consensus = self.consensus

        def run(_: TransferOp) -> None:
            done = 0
            for first in range(0, prefetch.hit_pages, PREFETCH_BATCH_PAGES):
                last = min(first + PREFETCH_BATCH_PAGES, prefetch.hit_pages)
                stopping = prefetch.stop.is_set()
                local = done
                if not stopping:
                    try:
                        local = first + self._read_batch(prefetch, first, last)
                    except Exception:  # noqa: BLE001 - a miss; the agreement below must still happen
                        logger.exception("storage read failed; its pages are treated as a miss")
                # MIN over every rank after each batch: a slow stop or a failed read on one rank
                # shortens everyone's prefix, and every rank leaves the loop at the same batch.
                done, go = consensus.agree_min_all("prefetch_read", [local, int(not stopping)])
                prefetch.progress.append(done)
                if not go or done < last:
                    prefetch.read_failed = bool(go)
                    return

        return run

    def _lose(self, reason: PrefetchLoss, pages: int) -> None:
        if pages:
            self.counters[f"prefetch_lost_{reason.value}_pages"] += pages
            logger.debug("prefetch: %d pages lost (%s)", pages, reason.value)

    @consensus_checked(params=("req.rid", "busy"), results=("result",))
    def ready_to_admit(self, req: Request, busy: bool) -> bool:
        prefetch = self.prefetches.get(req.rid)
        if prefetch is None or prefetch.done:
            return True
        if prefetch.read is None:
            return False  # the existence query is still out; it is quick
        policy = self.cfg.hicache_storage_prefetch_policy
        if policy == "best_effort":
            # Never hold up other work; but an idle engine has nothing better to do than finish the
            # read, which is cheaper than recomputing what it brings.
            finished = busy or prefetch.read.done.is_set()
        elif policy == "wait_complete":
            finished = prefetch.read.done.is_set()
        else:
            limit = self.cfg.hicache_storage_prefetch_timeout_base + (
                self.cfg.hicache_storage_prefetch_timeout_per_ki_token * prefetch.hit_pages * self.page_size / 1024
            )
            finished = prefetch.read.done.is_set() or time.monotonic() - prefetch.started >= limit
        # The first stage decides for every stage whether to stop waiting and how many entries of the
        # agreed read progress to use (later entries, already there on some ranks, are not used).
        stop, consume = self.consensus.agree_min("prefetch_stop", [int(finished), len(prefetch.progress)])
        prefetch.consume = consume
        return bool(stop)

    @consensus_checked(params=("req.rid",), results=("result",))
    def _consume_prefetch(self, req: Request) -> int:
        """Stop the request's prefetch and insert its agreed-on completed prefix as host-only nodes;
        returns the pages inserted."""
        prefetch = self.prefetches.pop(req.rid, None)
        if prefetch is None:
            return 0
        if prefetch.read is None:  # no host memory was taken: nothing to insert
            if prefetch.query is not None and not prefetch.done:
                prefetch.query.done.wait()
            return 0
        prefetch.stop.set()
        prefetch.read.done.wait()  # at most one batch in flight (its host pages are being written)
        completed = prefetch.progress[prefetch.consume - 1] if prefetch.consume else 0
        self.counters["prefetch_read_pages"] += completed
        unread = prefetch.host_pages[completed:]
        if unread:
            self.host.allocator.free(unread)
            self._lose(PrefetchLoss.READ_FAILED if prefetch.read_failed else PrefetchLoss.NOT_READ_IN_TIME, len(unread))
        if completed == 0:
            return 0
        end_page = prefetch.start_page + completed
        tokens = req.prompt_ids[: end_page * self.page_size]
        rejected = self.tree.insert_host(tokens, prefetch.host_pages[:completed], req.namespace)
        if rejected:
            self.host.allocator.free(rejected)
            reason = PrefetchLoss.PREFIX_EVICTED if len(rejected) == completed else PrefetchLoss.ALREADY_CACHED
            self._lose(reason, len(rejected))
        inserted = completed - len(rejected)
        self.counters["prefetch_inserted_pages"] += inserted
        if inserted:
            self.storage_origin[req.rid] = (prefetch.start_page, end_page)
        return inserted

    def _cancel_prefetch(self, req: Request) -> None:
        prefetch = self.prefetches.pop(req.rid, None)
        if prefetch is None:
            return
        prefetch.stop.set()
        for op in (prefetch.query, prefetch.read):
            if op is not None:
                op.done.wait()
        if prefetch.host_pages:
            self.host.allocator.free(prefetch.host_pages)
            self._lose(PrefetchLoss.CANCELLED, len(prefetch.host_pages))

    # ---- scheduler hooks -----------------------------------------------------------------------

    @consensus_checked(params=ADMIT_PARAMS, results=ADMIT_RESULTS)
    def admit(self, req: Request, total_pages: int, reserved_elsewhere: int) -> bool:
        self._consume_prefetch(req)
        admitted = super().admit(req, total_pages, reserved_elsewhere)
        self.storage_origin.pop(req.rid, None)
        if admitted and self.cfg.hicache_write_policy == "write_through_selective":
            for node in self.tree.path_to_root(req.lock_node):  # type: ignore[arg-type]
                if node.hit_count >= 2:
                    self._backup(node)
        return admitted

    @consensus_checked(params=RELEASE_PARAMS, results=())
    def release(self, req: Request) -> None:
        self._cancel_prefetch(req)
        super().release(req)

    def check(self) -> None:
        # One agreement per check, on every rank, even when every queue is empty.
        querying = self._querying()
        queried = [int(p.query.done.is_set()) for p in querying]  # type: ignore[union-attr]
        ready = [self.backups.ready(), self.loads.ready(), *queried]
        agreed_backups, agreed_loads, *queries = self.consensus.agree_min("transfer_acks", ready)
        backups, loads = self.backups.pop(agreed_backups), self.loads.pop(agreed_loads)
        self.consensus.confirm("transfer_acks", [op.ident * 2 + op.failed for op in backups + loads])
        finished: list[TreeNode] = []
        for op in backups:
            finished.extend(self._finish_backup(op))
        self._queue_storage_put(finished)
        for op in loads:
            if op.failed:
                logger.error("a host -> device load failed; the requests in its step failed with it")
        self._advance_prefetches([p for p, ok in zip(querying, queries) if ok])

    # ---- maintenance ---------------------------------------------------------------------------

    def _drain(self) -> None:
        while len(self.backups) or len(self.loads):
            for op in self.backups.drain():
                self._queue_storage_put(self._finish_backup(op))
            self.loads.drain()

    def flush(self) -> None:
        self._drain()
        self.tree.evict(self.tree.total_pages)
        self.tree.evict_host(self.host.allocator.num_pages)
        self.tree.reset()

    def leak_report(self) -> list[str]:
        problems = super().leak_report()
        host = self.host.allocator
        if host.free_pages != host.num_pages:
            problems.append(f"{host.num_pages - host.free_pages} host pages not freed")
        if self.prefetches:
            problems.append(f"{len(self.prefetches)} prefetches not consumed")
        return problems

    def usage(self) -> dict[str, tuple[int, int]]:
        usage = super().usage()
        host = self.host.allocator
        usage["host"] = (host.used_pages * host.page_size, host.num_pages * host.page_size)
        return usage

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = dict(self.counters)
        if self.store is not None:
            for name, value in vars(self.store.stats).items():
                stats[f"storage_{name}"] = value
        workers = [self.backup_worker, self.load_worker] + ([self.storage_worker] if self.store is not None else [])
        stats["transfer_worker_restarts"] = sum(w.restarts for w in workers)
        stats["transfer_failures"] = sum(w.failures for w in workers)
        return stats

    def shutdown(self) -> None:
        self._drain()
        for worker in (self.backup_worker, self.load_worker, getattr(self, "storage_worker", None)):
            if worker is not None:
                worker.stop()
        if self.store is not None:
            self.store.backend.close()
        self.consensus.flush()
