"""The storage tier (docs/DESIGN.md, "tiers"): content-addressed pages below host memory.

- Puts (storage_puts.py): a node backed up to the host is queued for storage; a put that found the
  store down is put again.
- Prefetch lifecycle (`Prefetch`): on arrival, the part of a prompt beyond the tree's match is looked up
  in storage (queried); if at least --hicache-storage-prefetch-threshold tokens are there, host pages
  are taken, only then (allocated), and the pages are read in the background (read). At admission the
  agreed-on completed prefix is inserted into the tree as host-only nodes (inserted), to be loaded back
  like any host hit. Every page lost on the way gets a reason code (`PrefetchLoss`).
- Agreements: the storage thread takes the MIN over every rank of the hit length before reading and of
  the pages read after each batch, and publishes that agreed progress in order; the scheduler consumes
  the number of progress entries the first stage chose, and the first stage decides when to stop waiting.
- Parts: with a speculative draft a page is two objects, the target's (under the keys a cache without a
  draft uses) and the draft's (under keys of its own, `Namespace.part`). Both are put together, and a
  hit is the MIN over the parts: a page whose draft object is missing or bad is not used (counted as
  `draft_missing`, or as a failed read), so a prefix is never restored for one model and not the other.
- Sharded pages (hicache/parallel/placement.py): keys carry the shard rank, each shard rank puts, looks up
  and reads only its own pages (`writes`: the elected writer of replicated bytes), so a rank's hit is
  the pages before the first of its own that is missing, and the MIN over the shard group is the
  common prefix. A prompt the tree does not know yet may have been stored from any rotation base: the
  lookup asks for every base at once and the agreed longest hit picks it, so the pages are read back
  onto the owners that wrote them (after a restart too).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from hicache.cache.controller import Clock, SupervisedWorker, TransferOp, Worker, WorkerFactory
from hicache.cache.host_tier import HostTier
from hicache.cache.page_keys import Tokens, pack
from hicache.cache.radix import RadixTree
from hicache.cache.stats import PrefetchLoss, StorageTierStats
from hicache.cache.storage_puts import StoragePuts
from hicache.cache.stores import part_store
from hicache.config import HiCacheConfig
from hicache.debug.consensus_checker import consensus_checked
from hicache.parallel.consensus import Consensus
from hicache.storage import StorageStats, VerifiedStore, page_hashes, salt_seed

logger = logging.getLogger(__name__)

# A prefetch reads in batches, each followed by one agreement across ranks on the pages read: the first
# of PREFETCH_FIRST_BATCH_PAGES (what a prefetch stopped early still brings), each next one twice the
# last, up to PREFETCH_BATCH_BYTES of a page's bytes on every rank (the most a stop waits for, the batch
# in flight). An 8K-page hit takes tens of agreements, not one per 8 pages.
PREFETCH_FIRST_BATCH_PAGES = 8
PREFETCH_BATCH_BYTES = 64 << 20


class PrefetchPolicy(str, enum.Enum):
    """When admission stops waiting for a prefetch (`--hicache-storage-prefetch-policy`)."""

    BEST_EFFORT = "best_effort"  # never hold up other work
    WAIT_COMPLETE = "wait_complete"  # until the read is done
    TIMEOUT = "timeout"  # until done or a time limit that grows with the hit


@dataclass(eq=False)
class Prefetch:
    """Lifecycle: queried -> allocated -> read -> inserted."""

    rid: int
    hashes: list[bytes]  # of the pages to look up (after the tree's match)
    start_page: int  # index of hashes[0] in the prompt
    started: float  # when it was queried, on the tier's clock (the timeout policy counts from it)
    rotation: int = 0  # the prefix's rotation base: which shard rank holds, and reads, which page
    query: TransferOp | None = None
    hit_pages: int = 0
    batch_pages: int = PREFETCH_FIRST_BATCH_PAGES  # the largest read batch, agreed with the hit
    host_pages: list[int] = field(default_factory=list)
    read: TransferOp | None = None
    # Leading pages read and verified on every rank, one entry per agreed batch, in order (written by
    # the storage worker): the ordered ACK queue of the read.
    progress: list[int] = field(default_factory=list)
    consume: int = 0  # how many progress entries admission uses (the first stage's choice)
    read_failed: bool = False  # a page was missing, corrupt or unreadable on some rank
    stop: threading.Event = field(default_factory=threading.Event)
    done: bool = False  # nothing more will happen before admission consumes it


@dataclass(frozen=True)
class Fetched:
    """What admission got from a request's prefetch: prompt pages [first_page, end_page) were read,
    `inserted` of them into the tree (the rest it had already, or lost their prefix)."""

    inserted: int = 0
    first_page: int = 0
    end_page: int = 0
    rotation: int = 0  # the rotation base the pages were read for (recorded by the consensus checker)

    @property
    def pages(self) -> range:
        return range(self.first_page, self.end_page) if self.inserted else range(0)


class StorageTier:
    def __init__(
        self,
        store: VerifiedStore,
        host: HostTier,
        consensus: Consensus,
        cfg: HiCacheConfig,
        debug_delay_s: float = 0.0,
        writes: bool = True,
        make_worker: WorkerFactory = SupervisedWorker,
        clock: Clock = time.monotonic,
    ) -> None:
        """`writes`: this rank is the elected writer of its pages' bytes (not a replica's). `make_worker`
        and `clock`: where the storage calls run and what time the prefetch timeout and put retries
        read (a thread and the monotonic clock; the simulator's virtual link and clock)."""
        self.store = store
        self.host = host
        self.placement = host.host.placement
        # (store, host part) per object of a page, the target's first (host_group.py).
        parts = host.host.parts
        self.parts = [(store, parts[0])] + [(part_store(store, part), part) for part in parts[1:]]
        self.tree: RadixTree = host.tree
        self.page_size = host.pool.page_size
        self.consensus = consensus
        self.threshold = cfg.hicache_storage_prefetch_threshold
        self.policy = PrefetchPolicy(cfg.hicache_storage_prefetch_policy)
        self.timeout_base = cfg.hicache_storage_prefetch_timeout_base
        self.timeout_per_ki_token = cfg.hicache_storage_prefetch_timeout_per_ki_token
        self.worker = make_worker("storage", debug_delay_s, consensus.pctx.rank * 16 + 2, cfg.hicache_transfer_timeout)
        self.clock = clock
        self.prefetches: dict[int, Prefetch] = {}
        self.stats = StorageTierStats()
        self.puts = StoragePuts(self.parts, host, self.worker, self.stats, writes, clock)

    # ---- prefetch: queried -> allocated -> read ------------------------------------------------

    def start_prefetch(self, rid: int, prompt: Tokens, namespace: str) -> None:
        """Look up what storage holds of the prompt beyond the tree's match (in the background). The
        tree is only peeked at: arrival changes nothing of it (`KVCache.open`). `prompt` is best the
        handle's `packed_prompt`: the peek and the hashes then read its int64s in place."""
        ids = np.frombuffer(pack(prompt), dtype=np.int64)
        total = (len(ids) - 1) // self.page_size  # the last prompt token is always computed
        match = self.tree.peek(ids[: len(ids) - 1], namespace)
        start = match.device_pages + match.host_pages
        if (total - start) * self.page_size < max(self.threshold, 1):
            return
        hashes = page_hashes(ids[: total * self.page_size], self.page_size, salt_seed(namespace))[start:]
        prefetch = Prefetch(rid, hashes, start, self.clock())
        consensus = self.consensus
        # A path the tree has fixes the base; a new prefix may have been stored from any (unified
        # objects are named without their writer, so any base reads them: the first).
        if match.rotation is not None or self.store.topology_independent:
            bases = [match.rotation or 0]
        else:
            bases = list(range(self.placement.shards))

        # The largest read batch from this rank's page bytes, which differ between PP stages (other
        # layers): its MIN is agreed with the hit, so every rank cuts the read into the same batches.
        batch_pages = max(PREFETCH_FIRST_BATCH_PAGES, PREFETCH_BATCH_BYTES // self.host.host.page_bytes)

        def query(op: TransferOp) -> None:
            found = [self._own_hits(hashes, start, base) for base in bases]
            # MIN over every rank before reading: the common prefix all ranks can load, per base, of
            # every part (and of the target's alone, to count what a missing draft part cost); the
            # longest (the lowest base on a tie) is where the pages were written from.
            agreed = consensus.agree_min_all("storage_hit_pages", [n for pair in found for n in pair] + [batch_pages])
            best = max(range(len(bases)), key=lambda i: (agreed[2 * i], -i))
            op.payload = (agreed[2 * best], agreed[2 * best + 1], bases[best], agreed[-1])

        prefetch.query = self.worker.submit(TransferOp("storage_query", query))
        self.prefetches[rid] = prefetch
        self.stats.prefetch.queried += len(hashes)

    def _own_hits(self, hashes: list[bytes], start: int, base: int) -> tuple[int, int]:
        """Leading pages of `hashes` (prompt pages start..) before the first of this rank's own, placed
        from rotation base `base`, that storage lacks: in some part, and in the target's part."""
        n = self.placement.shards
        rank = self.host.host.shard_rank
        own = [i for i in range(len(hashes)) if (base + start + i) % n == rank]
        try:
            present = [store.exists_prefix([hashes[i] for i in own]) for store, _ in self.parts]
        except Exception:  # noqa: BLE001 - a miss here; the agreement after it must still happen
            logger.exception("storage existence query failed; treated as a miss")
            present = [0]

        def hit(k: int) -> int:
            return own[k] if k < len(own) else len(hashes)

        return hit(min(present)), hit(present[0])

    def querying(self) -> list[Prefetch]:
        """Prefetches whose existence query may have finished (the same list on every rank)."""
        return [p for p in self.prefetches.values() if not p.done and p.read is None and p.query is not None]

    def advance(self, agreed_ready: list[Prefetch]) -> None:
        """Move prefetches whose existence query finished (on the first stage) to reading, taking host
        memory now."""
        for prefetch in agreed_ready:
            assert prefetch.query is not None
            prefetch.query.wait()  # finished on the first stage; here it may still be finishing
            payload = (0, 0, 0, 0) if prefetch.query.failed else prefetch.query.payload
            hit, target_hit, prefetch.rotation, prefetch.batch_pages = payload  # type: ignore[misc]
            prefetch.hit_pages = hit
            self.stats.prefetch.hit += hit
            self._lose(PrefetchLoss.DRAFT_MISSING, target_hit - hit)
            if hit * self.page_size < self.threshold:
                self._lose(PrefetchLoss.BELOW_THRESHOLD, hit)
                prefetch.done = True
                continue
            classes = self.host.budget.classes(prefetch.rotation, prefetch.start_page, hit)
            host_pages = self.host.alloc(hit, classes)
            if host_pages is None:
                self._lose(PrefetchLoss.HOST_FULL, hit)
                prefetch.done = True
                continue
            self.stats.prefetch.allocated += hit
            prefetch.host_pages = host_pages
            read = TransferOp("storage_read", self._read_run(prefetch), pages=hit)
            prefetch.read = self.worker.submit(read)

    def _read_batch(self, prefetch: Prefetch, first: int, last: int) -> int:
        """Read this rank's pages among [first, last) of the hit into their host pages, every part; how
        many leading pages of the range are good here (up to the first own page that did not verify in
        every part; a later part reads only what the earlier ones verified)."""
        host = self.host.host
        own = [j for j in range(first, last) if host.owns(prefetch.host_pages[j])]
        for store, part in self.parts:
            pages = [prefetch.host_pages[j] for j in own]
            hashes = [prefetch.hashes[j] for j in own]
            if not own:
                ok: list[bool] = []
            elif part.contiguous:
                ok = store.get_pages_into(hashes, [part.view(p) for p in pages])
            else:
                payloads = store.get_pages(hashes)
                ok = [p is not None for p in payloads]
                for page, payload in zip(pages, payloads):
                    if payload is not None:
                        part.write(page, payload)
            bad = next((j for j, good in zip(own, ok) if not good), None)
            if bad is not None:
                own = [j for j in own if j < bad]
                last = bad
        return last - first

    def _read_run(self, prefetch: Prefetch) -> Callable[[TransferOp], None]:
        consensus = self.consensus

        def run(_: TransferOp) -> None:
            done = 0
            for first, last in read_batches(prefetch.hit_pages, prefetch.batch_pages):
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
            self.stats.prefetch.lose(reason, pages)
            logger.debug("prefetch: %d pages lost (%s)", pages, reason.value)

    # ---- prefetch at admission: stop, insert ---------------------------------------------------

    def _stop_waiting(self, prefetch: Prefetch, busy: bool) -> bool:
        """This rank's view of whether admission should stop waiting for the read."""
        assert prefetch.read is not None
        read_done = prefetch.read.done.is_set()
        if self.policy is PrefetchPolicy.BEST_EFFORT:
            # Never hold up other work; but an idle engine has nothing better to do than finish the
            # read, which is cheaper than recomputing what it brings.
            return busy or read_done
        if self.policy is PrefetchPolicy.WAIT_COMPLETE:
            return read_done
        limit = self.timeout_base + self.timeout_per_ki_token * prefetch.hit_pages * self.page_size / 1024
        return read_done or self.clock() - prefetch.started >= limit

    def ready_to_admit(self, rid: int, busy: bool) -> bool:
        prefetch = self.prefetches.get(rid)
        if prefetch is None or prefetch.done:
            return True
        if prefetch.read is None:
            return False  # the existence query is still out; it is quick
        finished = self._stop_waiting(prefetch, busy)
        # The first stage decides for every stage whether to stop waiting and how many entries of the
        # agreed read progress to use (later entries, already there on some ranks, are not used).
        stop, consume = self.consensus.agree_min("prefetch_stop", [int(finished), len(prefetch.progress)])
        prefetch.consume = consume
        return bool(stop)

    @consensus_checked(params=("rid",), results=("result",))
    def consume(self, rid: int, prompt: Sequence[int], namespace: str) -> Fetched:
        """Stop the request's prefetch and insert its agreed-on completed prefix as host-only nodes."""
        prefetch = self.prefetches.pop(rid, None)
        if prefetch is None:
            return Fetched()
        if prefetch.read is None:  # no host memory was taken: nothing to insert
            if prefetch.query is not None and not prefetch.done:
                prefetch.query.wait()
            return Fetched()
        prefetch.stop.set()
        prefetch.read.wait()  # at most one batch in flight (its host pages are being written)
        completed = prefetch.progress[prefetch.consume - 1] if prefetch.consume else 0
        self.stats.prefetch.read += completed
        unread = prefetch.host_pages[completed:]
        if unread:
            self.host.free(unread)
            self._lose(PrefetchLoss.READ_FAILED if prefetch.read_failed else PrefetchLoss.NOT_READ_IN_TIME, len(unread))
        if completed == 0:
            return Fetched()
        end_page = prefetch.start_page + completed
        tokens = prompt[: end_page * self.page_size]
        rejected = self.tree.insert_host(tokens, prefetch.host_pages[:completed], namespace, prefetch.rotation)
        if rejected:
            self.host.free(rejected)
            reason = PrefetchLoss.PREFIX_EVICTED if len(rejected) == completed else PrefetchLoss.ALREADY_CACHED
            self._lose(reason, len(rejected))
        inserted = completed - len(rejected)
        self.stats.prefetch.inserted += inserted
        return Fetched(inserted, prefetch.start_page, end_page, prefetch.rotation)

    def cancel(self, rid: int) -> None:
        """The request went away before admission consumed its prefetch."""
        prefetch = self.prefetches.pop(rid, None)
        if prefetch is None:
            return
        prefetch.stop.set()
        for op in (prefetch.query, prefetch.read):
            if op is not None:
                op.wait()
        if prefetch.host_pages:
            self.host.free(prefetch.host_pages)
            self._lose(PrefetchLoss.CANCELLED, len(prefetch.host_pages))

    # ---- maintenance ---------------------------------------------------------------------------

    @property
    def workers(self) -> list[Worker]:
        return [self.worker]

    def leak_report(self) -> list[str]:
        return [f"{len(self.prefetches)} prefetches not consumed"] if self.prefetches else []

    def snapshot(self) -> StorageTierStats:
        """A copy of the counters, with the store's own."""
        return dataclasses.replace(copy.deepcopy(self.stats), store=_summed([store.stats for store, _ in self.parts]))

    def shutdown(self) -> None:
        self.worker.stop()  # the queued puts run first
        self.puts.put_unstored()
        self.store.backend.close()


def read_batches(pages: int, most: int) -> Iterator[tuple[int, int]]:
    """[first, last) of each read batch of a `pages`-page hit: PREFETCH_FIRST_BATCH_PAGES, then twice
    the last, up to `most` pages."""
    first, size = 0, PREFETCH_FIRST_BATCH_PAGES
    while first < pages:
        last = min(first + size, pages)
        yield first, last
        first, size = last, min(2 * size, most)


def _summed(stats: list[StorageStats]) -> StorageStats:
    """The stores' counters together (with a draft part, a page is two objects)."""
    fields = dataclasses.fields(StorageStats)
    return StorageStats(**{f.name: sum(getattr(s, f.name) for s in stats) for f in fields})
