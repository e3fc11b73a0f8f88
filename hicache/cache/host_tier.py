"""The host tier (docs/DESIGN.md, "tiers"): host memory behind the device pool.

- Backups: the write policy (`WritePolicy`) decides when a device node is copied to the host: at
  creation, at its second hit, or when it is evicted from the device. An asynchronous backup locks its
  node until its ACK is consumed (its device pages must stay put while they are copied).
- Load-back: a match that continues into host-only nodes gets device pages for all of them (all or
  nothing; hits under --hicache-load-back-threshold tokens are recomputed instead).
- Layer events: a load copies layer by layer, so the forward pass of layer i waits only for layer i.
- Every consumption of a completed copy goes through `Consensus` (identity at one rank): ranks agree
  on how many ACKs to consume, then fold the identities of what they consumed into the chain the next
  agreement compares.
- Sharded pages (hicache/parallel/placement.py): a host page takes the owner class of the device page it
  backs up, and a load-back allocates device pages through the nodes' rotation base (both asked of the
  page budget, page_budget.py), so every page
  returns to its owner whatever its new physical page; each rank copies only its own pairs (the host
  pool's copy boundary), about 1/N of the bytes. The tree, the queues and the ACKs stay logical.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from typing import Callable, Sequence

from hicache.cache.controller import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    AckQueue,
    CopyStream,
    SupervisedWorker,
    TransferOp,
    TransferTimeout,
    Worker,
    WorkerFactory,
)  # fmt: skip
from hicache.cache.failed_loads import FailedLoads, IssuedLoad, LoadLedger
from hicache.cache.kv_events import HOST
from hicache.cache.page_budget import PageBudget
from hicache.cache.page_keys import key_digest
from hicache.cache.radix import MatchResult, RadixTree, TreeNode
from hicache.cache.stats import HostStats
from hicache.config import HiCacheConfig
from hicache.debug.consensus_checker import consensus_checked
from hicache.debug.faults import InjectedFault, LoadFaults
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_group import DraftPools, make_host_pool
from hicache.mem.host_pool import HostKVPool
from hicache.parallel.consensus import Consensus

logger = logging.getLogger(__name__)


class WritePolicy(str, enum.Enum):
    """When a device node gets a host copy (`--hicache-write-policy`)."""

    WRITE_THROUGH = "write_through"  # at creation
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # at its second hit
    WRITE_BACK = "write_back"  # when it leaves the device

    @property
    def backs_up_new_nodes(self) -> bool:
        return self is WritePolicy.WRITE_THROUGH

    @property
    def backs_up_hits(self) -> bool:
        return self is WritePolicy.WRITE_THROUGH_SELECTIVE

    @property
    def backs_up_on_evict(self) -> bool:
        return self is WritePolicy.WRITE_BACK


SELECTIVE_MIN_HITS = 2  # write_through_selective backs up a node at this many hits


def host_pool_pages(pool: DeviceKVPool, cfg: HiCacheConfig, draft: DraftPools | None = None) -> int:
    """Host capacity in pages: --hicache-size GB if given (a page holding a draft's state too, when it
    has one), else --hicache-ratio times the device pool. A host tier no larger than the device pool is
    allowed but warned about: it holds little beyond copies of what the device has, so host hits and
    prefetches mostly evict each other."""
    # Per rank: a sharded pool's ranks each hold their own pages, so each gets the budget for its own.
    least = 2 if pool.sharded else 1  # a padding page and a page
    if cfg.hicache_size > 0:
        page_bytes = make_host_pool(pool, least, cfg.hicache_mem_layout, draft).page_bytes
        pages = max(int(cfg.hicache_size * 1e9) // page_bytes, least)
    else:
        pages = max(int(pool.local_pages * cfg.hicache_ratio), least)
    if pages <= pool.local_pages:
        logger.warning(
            "the host tier (%d pages) is no larger than the device pool (%d pages): it will mostly hold copies "
            "of device-resident prefixes, which are dropped (LRU, hicache_cache_events{event=\"host_copies_dropped_"
            "pages\"}) to make room for prefetches and backups; raise --hicache-ratio above 1 for host hits",
            pages, pool.local_pages,
        )
    return pages


class HostTier:
    def __init__(
        self,
        pool: DeviceKVPool,
        host: HostKVPool,
        tree: RadixTree,
        budget: PageBudget,
        consensus: Consensus,
        policy: WritePolicy,
        load_back_threshold: int,
        debug_delay_s: float = 0.0,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        load_faults: LoadFaults | None = None,
        make_worker: WorkerFactory = SupervisedWorker,
    ) -> None:
        """`tree` must free removed nodes' host pages into `host` (its on_host_free). `load_faults`:
        which loads fail (fault injection, wired in by build.py). `make_worker`: where copies run
        (threads; the capacity simulator's virtual-time links)."""
        self.pool = pool
        self.host = host
        self.tree = tree
        self.budget = budget
        self.consensus = consensus
        self.policy = policy
        self.load_back_threshold = load_back_threshold
        self.copies = CopyStream(pool.device)
        rank = consensus.pctx.rank
        # Per-rank seeds: the ranks' copies finish in different orders, which is what agreement is for.
        self.backup_worker = make_worker("backup", debug_delay_s, rank * 16, transfer_timeout_s)
        self.load_worker = make_worker("load", debug_delay_s, rank * 16 + 1, transfer_timeout_s)
        # Fault injection for restores: the layers of a load land late, in a different rhythm on every
        # rank, so a reader that does not wait for a layer's event reads pages not restored yet.
        self._layer_delay_s = debug_delay_s
        self._layer_rng = random.Random(rank * 16 + 3)
        self._load_faults = load_faults
        self.ledger = LoadLedger(consensus)  # loads to judge after the step that needed them
        self.backups = AckQueue()
        self.loads = AckQueue()
        self.stats = HostStats()

    @property
    def workers(self) -> list[Worker]:
        return [self.backup_worker, self.load_worker]

    # ---- host memory ---------------------------------------------------------------------------

    @consensus_checked(params=("n", "classes"), results=("result",))
    def alloc(self, n: int, classes: Sequence[int] | None = None) -> list[int] | None:
        """n host pages, page i of owner class classes[i] (None: one class), evicting host-only cache
        first, then the host copies of device-resident prefixes (LRU), until every class asked for has
        room; None if even that is not enough."""
        classes = list(classes) if classes is not None else [0] * n
        for make_room in (self.tree.evict_host, self._drop_host_copies):
            while (short := self.budget.short(self.host.allocator, classes)) > 0 and make_room(short) > 0:
                pass
        return self.host.allocator.alloc(n, classes)

    def _drop_host_copies(self, num_pages: int) -> int:
        """Free host copies of unlocked device-resident nodes, least recently used first. Without this a
        host tier full of copies of what the device holds starves prefetch and new backups for good
        (SGLang never evicts them). A dropped copy costs only a re-backup (or, for write-through, the
        node's host life after it leaves the device); a locked node may be mid-load or mid-backup, and
        storage puts copy their payloads when queued, so nothing in flight reads a freed page."""
        candidates = [
            n for n in self.tree.nodes()
            if n.host_pages is not None and n.on_device and n.lock_ref == 0 and not n.backup_pending
        ]  # fmt: skip
        freed = 0
        priority = self.tree.retention.effective  # retained copies go last (docs/DESIGN.md, "retention hints")
        for node in sorted(candidates, key=lambda n: (priority(n), n.last_access, n.id)):
            if freed >= num_pages:
                break
            self.tree.events.removed(node, HOST)
            self.tree.retention.evicted(node, len(node.host_pages or []), HOST)
            pages, node.host_pages = node.host_pages or [], None
            self.free(pages)
            freed += len(pages)
        self.stats.host_copies_dropped_pages += freed
        return freed

    def free(self, pages: list[int]) -> None:
        self.host.allocator.free(pages)

    # ---- device -> host backups ----------------------------------------------------------------

    def backup(self, node: TreeNode) -> None:
        """Start copying a device node to the host (nothing if it has a host copy or no device pages, or if
        a page lost its window KV: host pages hold whole rows, hicache/cache/sliding_tier.py)."""
        if node.host_pages is not None or node.device_pages is None or not self.pool.whole_rows(node.device_pages):
            return
        host_pages = self.alloc(len(node.device_pages), self.budget.classes_of(node.device_pages))
        if host_pages is None:
            self.stats.backup_skipped_host_full_pages += len(node.device_pages)
            return
        node.host_pages = host_pages
        self.tree.events.stored(node, HOST)
        node.backup_pending = True
        self.tree.lock(node)
        device_pages = list(node.device_pages)
        fence = self.copies.fence()

        def run(_: TransferOp) -> None:
            self.copies.run(fence, lambda: self.host.backup(self.pool, device_pages, host_pages))

        op = TransferOp("backup", run, payload=node, pages=len(device_pages))
        op.ident = hash((key_digest(node.key), device_pages[0], len(device_pages)))  # same on every rank
        self.backups.push(op)
        self.backup_worker.submit(op)

    def on_new_nodes(self, nodes: list[TreeNode]) -> None:
        if self.policy.backs_up_new_nodes:
            for node in nodes:
                self.backup(node)

    def on_hit(self, path: list[TreeNode]) -> None:
        """`path`: an admitted request's prefix, root first."""
        if self.policy.backs_up_hits:
            for node in path:
                if node.hit_count >= SELECTIVE_MIN_HITS:
                    self.backup(node)

    def write_back(self, node: TreeNode) -> bool:
        """For a node leaving the device without a host copy: True if it was copied to the host now."""
        if not self.policy.backs_up_on_evict or node.host_pages is not None:
            return False
        if not self.pool.whole_rows(node.device_pages or []):
            return False
        device_pages = list(node.device_pages or [])
        host_pages = self.alloc(len(device_pages), self.budget.classes_of(device_pages))
        if host_pages is None:
            self.stats.backup_skipped_host_full_pages += len(device_pages)
            return False
        # Synchronously: the device pages are about to be reused.
        self.copies.run(self.copies.fence(), lambda: self.host.backup(self.pool, device_pages, host_pages))
        node.host_pages = host_pages
        self.tree.events.stored(node, HOST)
        self._count_backup(len(host_pages))
        return True

    def _count_backup(self, pages: int) -> None:
        self.stats.backup_pages += pages
        self.stats.backup_bytes += pages * self.host.page_bytes

    def _finish_backup(self, op: TransferOp) -> list[TreeNode]:
        """Apply one acknowledged backup to its node and the nodes a split cut off above it; the nodes
        now backed up."""
        node: TreeNode = op.payload  # type: ignore[assignment]
        self.tree.unlock(node)
        finished = []
        while node is not None and not node.is_root and node.backup_pending:
            node.backup_pending = False
            if op.failed:
                self.tree.events.removed(node, HOST)
                self.free(node.host_pages or [])
                node.host_pages = None
            else:
                self._count_backup(len(node.host_pages or []))
                finished.append(node)
            node = node.parent  # type: ignore[assignment]
        return finished

    # ---- ACKs ----------------------------------------------------------------------------------

    def acks_ready(self) -> list[int]:
        """This rank's view: how many leading backups and loads have completed."""
        return [self.backups.ready(), self.loads.ready()]

    def consume_acks(self, backups: int, loads: int) -> list[TreeNode]:
        """Apply the agreed-on numbers of backup and load ACKs; the nodes now backed up."""
        backup_ops, load_ops = self.backups.pop(backups), self.loads.pop(loads)
        # Backups' failures are compared; loads' are agreed when settled (failed_loads.py), which may
        # come after their ACKs.
        acks = [op.ident * 2 + op.failed for op in backup_ops] + [op.ident for op in load_ops]
        self.consensus.confirm("transfer_acks", acks)
        finished: list[TreeNode] = []
        for op in backup_ops:
            finished.extend(self._finish_backup(op))
        self.pool.free(self.ledger.release(load_ops))  # quarantined pages whose copies stopped
        return finished

    def drain(self) -> list[list[TreeNode]]:
        """Wait for every copy in flight and apply it (no agreement: every rank drains all); the nodes
        each backup left backed up."""
        finished = []
        while len(self.backups) or len(self.loads):
            finished.extend(self._finish_backup(op) for op in self.backups.drain())
            self.loads.drain()
        self.pool.free(self.ledger.release())
        return finished

    # ---- host -> device loads ------------------------------------------------------------------

    def load_back(
        self, match: MatchResult, budget: int, alloc: Callable[[int, Sequence[int]], list[int]]
    ) -> IssuedLoad | None:
        """The load of every host-only node of `match` into device pages (from `alloc(n, classes)`),
        layer by layer; None if the host part is under the threshold or more than `budget` pages."""
        host_pages = match.host_pages
        if not host_pages or len(host_pages) * self.pool.page_size < self.load_back_threshold:
            return None
        if len(host_pages) > budget:
            return None
        # Through the path's rotation base: each page returns to the owner its host copy is on.
        rotation, first = match.last_node.rotation, len(match.device_pages)
        classes = self.budget.classes(rotation, first, len(host_pages))
        assert classes == self.budget.classes_of(host_pages), "a host page is off its prefix's owner cycle"
        device_pages = alloc(len(host_pages), classes)
        offset = 0
        for node in match.host_nodes:
            k = len(node.host_pages or [])
            self.tree.attach_device(node, device_pages[offset : offset + k])
            offset += k
        layer_done = [threading.Event() for _ in range(self.pool.num_layers)]
        fence = self.copies.fence()

        # (the whole load at most the configured delay late, as every other transfer)
        per_layer = self._layer_delay_s / len(layer_done)
        delays = [self._layer_rng.uniform(0, per_layer) for _ in layer_done] if per_layer else []

        fail_at = self._load_faults.layer_to_fail(len(layer_done)) if self._load_faults else None

        def run(_: TransferOp) -> None:
            for layer, event in enumerate(layer_done):
                if delays:
                    time.sleep(delays[layer])
                if layer == fail_at:
                    raise InjectedFault(f"host -> device load failed at layer {layer} (--debug-load-fail-rate)")
                self.copies.run(fence, lambda: self.host.load_layer(self.pool, layer, host_pages, device_pages))
                event.set()

        op = TransferOp("load", run, payload=layer_done, pages=len(host_pages))
        op.ident = hash((tuple(key_digest(n.key) for n in match.host_nodes), device_pages[0], len(device_pages)))
        self.loads.push(op)
        load = IssuedLoad(op, layer_done, tuple(match.host_nodes), device_pages)
        self.ledger.issued(load)
        self.load_worker.submit(op)
        self.stats.load_pages += len(host_pages)
        self.stats.load_bytes += len(host_pages) * self.host.page_bytes
        return load

    def before_layer(self) -> Callable[[int], None] | None:
        """Wait (bounded) for layer i of every load in flight now but restores, which no step reads
        before they land (restores.py) (None: nothing in flight). A load the ledger settles that failed
        or timed out, on any pipeline stage, is only noted: the step goes on and the load is settled
        after it, over every rank (failed_loads.py); any other load's failure fails the step."""
        pending = [op for op in self.loads.running() if self.ledger.awaited(op)]
        if not pending:
            return None
        loads = [(op, self.ledger.degradable(op)) for op in pending]

        def wait(layer: int) -> None:
            for op, load in loads:
                events: list[threading.Event] = op.payload  # type: ignore[assignment]
                if load is None:
                    op.wait(events[layer])
                    if op.failed:
                        raise RuntimeError(f"host -> device load failed: {op.error}")
                    continue
                if load.timed_out:
                    continue
                try:
                    op.wait(events[layer])
                except TransferTimeout:
                    load.timed_out = True
                    logger.warning("a host -> device load timed out at layer %d; its requests will recompute", layer)

        return wait

    def settle_loads(self) -> FailedLoads:
        """The loads issued since the last settle that did not land on every rank (agreed)."""
        failed = self.ledger.settle()
        for load in failed.loads:
            if load.timed_out or not load.op.done.is_set():
                self.stats.load_timed_out_pages += len(load.device_pages)
            else:
                self.stats.load_failed_pages += len(load.device_pages)
            logger.warning("a host -> device load of %d pages did not land (%s)", len(load.device_pages),
                           load.op.error or "timed out")  # fmt: skip
        return failed

    # ---- maintenance ---------------------------------------------------------------------------

    def evict_all(self) -> None:
        self.tree.evict_host(self.host.allocator.num_pages)

    def leak_report(self) -> list[str]:
        a = self.host.allocator
        problems = [f"{a.num_pages - a.free_pages} host pages not freed"] if a.free_pages != a.num_pages else []
        if self.ledger.quarantined_pages:
            problems.append(f"{self.ledger.quarantined_pages} device pages held for loads still copying")
        return problems

    def usage(self) -> tuple[int, int]:
        """(used, capacity) in tokens."""
        a = self.host.allocator
        return a.used_pages * a.page_size, a.num_pages * a.page_size

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.stop()
