"""The radix prefix cache behind the cache API (docs/DESIGN.md, "cache API"): it owns the requests' KV
handles and the reservations, and runs admission over the device tier. It is composed, not extended:
the device tier always, and, with the hierarchical cache on, the `LowerTiers` below it (lower_tiers.py:
the host tier, and the storage tier when configured), asked wherever a lower tier takes part. build.py
puts the parts together from the configuration.

Lease contract: a READY handle holds exactly one tree lock (`handle.lock`) until it is released;
moving it deeper (after its prompt is cached) locks the new node before unlocking the old one.

NOTE (memory invariant): a request is admitted only if the pages it may ever need (prompt + max new
tokens, less its cached prefix) fit in free + evictable pages minus what admitted requests were
promised (`reserved_pages`); so a READY handle can always `extend`, evicting unlocked cache if needed,
and never runs out of KV memory mid-way. With sharded pages this holds per owner class (the page
budget, page_budget.py, keeps the promises and answers room; the handle's pages cycle through the
classes from its `rotation`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from hicache.cache.api import Admission, KVHandle, KVState, PrefixMatch, RestoreStatus
from hicache.cache.device_tier import DeviceTier
from hicache.cache.failed_loads import FailedLoads, IssuedLoad
from hicache.cache.hybrid_hits import HybridHits
from hicache.cache.lower_tiers import LowerTiers
from hicache.cache.page_keys import Tokens
from hicache.cache.radix import MatchResult, TreeNode
from hicache.cache.restores import Restores
from hicache.cache.retention import NO_RETENTION, Retention
from hicache.cache.snapshot_policy import SnapshotPolicy
from hicache.cache.stats import CacheStats
from hicache.debug.consensus_checker import consensus_checked

logger = logging.getLogger(__name__)

# What must agree across ranks about an admission: its inputs, the decision, the matched length by tier.
ADMIT_PARAMS = {"rid": "handle.rid", "total_pages": "total_pages", "reserved_elsewhere": "self.budget.reserved_pages"}
ADMIT_RESULTS = {
    "result": "result.admitted",
    "kv_len": "handle.kv_len",
    "cached_tokens_by_tier": "handle.cached_tokens_by_tier",
    "reserved_pages": "handle.reserved_pages",
}
RELEASE_PARAMS = {"rid": "handle.rid", "kv_len": "handle.kv_len"}


@dataclass(frozen=True)
class Reserved:
    """What `PrefixCache._reserve_prefix` matched and locked."""

    cached: PrefixMatch  # the reused prefix by the tier that holds it
    lock: TreeNode | None  # the deepest node of that prefix, locked for the handle (None: radix off)
    load: IssuedLoad | None  # the load of its host-only part back to the device (None: nothing loads)


class PrefixCache:
    def __init__(
        self,
        device: DeviceTier,
        lower: LowerTiers | None = None,
        radix: bool = True,
        draft: bool = False,
        skip_draft_restore: bool = False,
        snapshots: SnapshotPolicy | None = None,
    ) -> None:
        """`lower`: the host (and storage) tiers below the device; None: the device tier alone.
        `radix`: False with the radix cache off, where no prompt is matched or cached (nor any lower
        tier possible). `draft`: a speculative draft's pools share the device pages (hicache/spec/):
        handles then track the draft's length beside the target's (`KVHandle.draft_len`);
        `skip_draft_restore`: loads restore the target's layers only, so the draft recomputes what
        came from a lower tier (a negative control). `snapshots`: where a hybrid model's recurrent state is
        kept, so where its hits may end."""
        if lower is not None and not radix:
            raise ValueError("lower tiers hold what the radix tree caches: they need it on")
        self.device = device
        self.lower = lower
        self.radix = radix
        self.draft = draft
        self.skip_draft_restore = skip_draft_restore
        self.pool = device.pool
        self.page_size = self.pool.page_size
        self.tree = device.tree
        self.events = device.tree.events
        self.budget = device.budget
        # What `reserve` restores, judged by the host tier's ledger (nothing restores without one).
        self.restores = Restores(lower.host.ledger, lower.consensus) if lower is not None else Restores()
        self._keep_on_evict = lower.keep_on_evict if lower is not None else None
        # A hybrid model's hit rules (hybrid_hits.py); None: a hit is the whole cached prefix.
        self.hybrid = None
        if device.sliding is not None or snapshots is not None:
            self.hybrid = HybridHits(self.tree, device.sliding, snapshots, device.free)

    # ---- a handle's life -----------------------------------------------------------------------

    def open(self, rid: int, prompt: Sequence[int], namespace: str, retention: Retention = NO_RETENTION) -> KVHandle:
        draft_len = 0 if self.draft else None
        handle = KVHandle(
            rid, prompt, namespace, self.page_size, slot_device=self.pool.device, draft_len=draft_len,
            retention=retention,
        )  # fmt: skip
        if self.lower is not None:
            self.lower.open(handle)
        return handle

    @consensus_checked(params={"rid": "handle.rid", "busy": "busy"}, results=("result",))
    def ready_to_admit(self, handle: KVHandle, busy: bool) -> bool:
        return self.lower is None or self.lower.ready_to_admit(handle, busy)

    def lookup(self, prompt: Sequence[int], namespace: str) -> PrefixMatch:
        # The prefix admission matches (`admit`): all of the prompt but its last token.
        peek = self.tree.peek(prompt[: len(prompt) - 1], namespace)
        if self.hybrid is not None:
            return self.hybrid.lookup(peek)
        return PrefixMatch(device=peek.device_tokens, host=peek.host_tokens)

    @consensus_checked(params=ADMIT_PARAMS, results=ADMIT_RESULTS)
    def admit(self, handle: KVHandle, total_pages: int) -> Admission:
        if handle.state is not KVState.WAITING:
            raise RuntimeError(f"request {handle.rid}: admission of a {handle.state.value} handle")
        if self.restores.blocks_admission():
            return Admission(False)  # a hit on a restore's pages would read them before they land
        # At least the last prompt token is always computed: its logits give the first output token.
        reserved = self._reserve(handle, handle.packed_prompt.view(len(handle.prompt) - 1), total_pages)
        if reserved is None:
            return Admission(False)
        admission = self._ready(handle, total_pages - len(handle.pages), reserved.cached, reserved.lock)
        if self.lower is not None:
            self.lower.on_admitted(handle)
        return admission

    @consensus_checked(params=ADMIT_PARAMS, results=ADMIT_RESULTS)
    def reserve(self, handle: KVHandle, total_pages: int) -> Admission:
        if handle.state is not KVState.WAITING:
            raise RuntimeError(f"request {handle.rid}: reservation of a {handle.state.value} handle")
        reserved = self._reserve(handle, handle.packed_prompt, total_pages)
        if reserved is None:
            return Admission(False)
        self.restores.track(handle, reserved.load)
        self._reserve_rest(handle, total_pages - len(handle.pages), reserved.cached, reserved.lock)
        self._restored_draft(handle)
        self.extend(handle, len(handle.prompt))  # the pages the outside KV lands in
        return Admission(True, reserved.cached, handle.reserved_pages)

    def restore_status(self, handle: KVHandle) -> RestoreStatus:
        return self.restores.status(handle)

    def complete(self, handle: KVHandle) -> None:
        if handle.state is not KVState.RESERVED:
            raise RuntimeError(f"request {handle.rid}: completion of a {handle.state.value} handle")
        self.restores.landed(handle)
        handle.enter(KVState.READY)
        prefix = handle.kv_len
        handle.advance(len(handle.prompt))
        if self.device.sliding is not None:
            self.device.sliding.landed(handle.pages, prefix, len(handle.prompt))
        if handle.draft_len == prefix and not self.skip_draft_restore:  # the outside KV had the draft's rows
            handle.advance_draft(len(handle.prompt))
        if handle.lock is not None and self.lower is not None:
            self.lower.on_admitted(handle)
        # Only what every pool holds: a draft without its rows shares the prompt once it caught up on it.
        self.cache_prefix(handle, handle.prompt[: handle.valid_len])

    def fail(self, handle: KVHandle) -> None:
        self.release(handle, handle.prompt[: handle.kv_len])  # the prefix's pages were the tree's all along

    def _reserve(self, handle: KVHandle, tokens: Tokens, total_pages: int) -> Reserved | None:
        """WAITING → RESERVED over the cached prefix of `tokens` (`_reserve_prefix`), or, with the radix
        cache off, over nothing (no lock, no load) if `total_pages` fit; else WAITING (None). The one
        place where the radix cache being off matters: without a tree path (`handle.lock` None) nothing
        is cached later either."""
        if self.radix:
            return self._reserve_prefix(handle, tokens, total_pages)
        handle.rotation = self.budget.new_rotation()
        if not self.budget.room(handle.rotation, 0, total_pages):
            return None
        handle.enter(KVState.RESERVED)
        return Reserved(PrefixMatch(), None, None)

    def _reserve_prefix(self, handle: KVHandle, tokens: Tokens, total_pages: int) -> Reserved | None:
        """WAITING → MATCHED → LOCKED → RESERVED over the cached prefix of `tokens`: match it (a finished
        prefetch is inserted first), lock it, and, if the `total_pages` less its device part fit in
        free + evictable pages minus what others were promised (checked with the prefix locked), start
        loading its host part back; else back to WAITING holding nothing (None). The handle then holds
        the prefix's pages (kv_len = committed_len = their tokens) and one lock, on `Reserved.lock`;
        promising the rest is the caller's: `admit` goes on to READY, `reserve` stops here while the
        rest of the prompt's KV arrives from outside. Changes the tree: yes."""
        if self.lower is not None and (fetched := self.lower.fetched(handle)):
            handle.from_storage = fetched
        fetched = handle.from_storage
        match, lost = self._match(handle, tokens)
        handle.enter(KVState.MATCHED)
        self.tree.lock(match.last_node)  # also keeps a host-resident continuation from host eviction
        handle.enter(KVState.LOCKED)
        handle.rotation = match.rotation if match.rotation is not None else self.budget.new_rotation()
        need = total_pages - len(match.device_pages)
        room = self.budget.room(handle.rotation, len(match.device_pages), need)
        if not room or not self.device.sliding_room(need, self.budget.reserved_pages):
            self.tree.unlock(match.last_node)
            handle.enter(KVState.WAITING)
            return None
        if self.device.sliding is not None:
            self.device.sliding.admitted(lost)
        handle.enter(KVState.RESERVED)
        handle.table.append(match.device_pages)  # a waiting handle holds no page
        # Without a lower tier no node is host-only, so nothing loads.
        host = self.lower.host if self.lower is not None and handle.load_host else None
        load = host.load_back(match, need, self.alloc) if host is not None else None
        loaded = load.device_pages if load is not None else []
        handle.table.append(loaded)
        deepest = match.host_nodes[-1] if loaded else match.last_device_node
        self.tree.lock(deepest)
        self.tree.unlock(match.last_node)
        first = len(match.device_pages)
        in_storage = range(max(first, fetched.start), min(first + len(loaded), fetched.stop))
        cached = PrefixMatch(
            device=match.num_tokens,
            host=(len(loaded) - len(in_storage)) * self.page_size,
            storage=len(in_storage) * self.page_size,
        )
        handle.kv_len = len(handle.pages) * self.page_size
        handle.committed_len = handle.kv_len  # those pages are the tree's
        return Reserved(cached, deepest, load)

    def _match(self, handle: KVHandle, tokens: Tokens) -> tuple[MatchResult, int]:
        """The cached prefix of `tokens`, counted as a hit, and the pages the window rule cut from it: on a
        hybrid model it goes only as far as its rules allow (hybrid_hits.py: the match looks first, then
        takes that much)."""
        lost = 0
        if self.hybrid is not None:
            valid, lost = self.hybrid.match(tokens, handle.namespace)
            tokens = handle.packed_prompt.view(valid * self.page_size)
        match = self.tree.match_prefix(tokens, handle.namespace, count_hit=True, retention=handle.retention)
        return match, lost

    @property
    def reserved_pages(self) -> int:
        """Pages promised to handles and not yet allocated by them."""
        return self.budget.reserved_pages

    @property
    def reserved_by_class(self) -> list[int]:
        """The same, by owner class."""
        return self.budget.reserved_by_class

    def _promise(self, handle: KVHandle, n: int, sign: int) -> None:
        """Count (sign +1) or uncount (-1) the handle's next n pages, from len(pages) on, as promised."""
        self.budget.promise(handle.rotation, len(handle.pages), n, sign)

    def _reserve_rest(self, handle: KVHandle, reserve: int, cached: PrefixMatch, lock: TreeNode | None) -> None:
        """Promise the handle `reserve` more pages (counted against admission, by owner class) and
        record its cached prefix and lock: what `admit` and `reserve` do after matching."""
        handle.reserved_pages = reserve
        handle.cached = cached
        handle.lock = lock
        self._promise(handle, reserve, +1)

    def _ready(self, handle: KVHandle, reserve: int, cached: PrefixMatch, lock: TreeNode | None) -> Admission:
        self._reserve_rest(handle, reserve, cached, lock)
        self._restored_draft(handle)
        handle.enter(KVState.READY)
        return Admission(True, cached, reserve)

    def _restored_draft(self, handle: KVHandle) -> None:
        """The draft's part of the handle's cached prefix: all of it (a tree page holds every pool's
        state, and a restore moves them together), less what `skip_draft_restore` leaves out."""
        if handle.draft_len is not None:  # the effective hit is the MIN over every pool it needs
            unrestored = handle.cached.host + handle.cached.storage if self.skip_draft_restore else 0
            handle.draft_len = handle.kv_len - unrestored

    def extend(self, handle: KVHandle, end: int) -> None:
        want = -(-end // self.page_size) - len(handle.pages)
        if want <= 0:
            return
        if want > handle.reserved_pages:
            raise RuntimeError("KV reservation invariant broken: a request outgrew its reservation")
        self._promise(handle, want, -1)
        self.budget.hold(handle.rotation, len(handle.pages), want, +1)
        classes = self.budget.classes(handle.rotation, len(handle.pages), want)
        handle.table.append(self.device.alloc(want, keep_if=self._keep_on_evict, classes=classes))
        handle.reserved_pages -= want

    def alloc(self, n: int, classes: Sequence[int] | None = None) -> list[int]:
        """n device pages (of `classes`) outside any reservation's accounting (a load-back's, which
        admission counted)."""
        return self.device.alloc(n, keep_if=self._keep_on_evict, classes=classes)

    def cache_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        n = len(tokens) - len(tokens) % self.page_size
        if handle.lock is None or n == 0:  # no tree path: the radix cache is off
            return
        # `tokens` is the request's sequence, its prompt first: the prompt is packed once per request
        # and only what follows it (the output, at release) is converted here.
        key = handle.packed_prompt.prefix_of(tokens, n)
        pages = handle.pages[: n // self.page_size]
        res = self.device.insert(key, pages, handle.namespace, handle.rotation, handle.retention)
        if res.refused:  # another placement of these tokens is cached: this request keeps its own pages
            return
        handle.table.replace(res.pages)
        self.tree.lock(res.last_node)
        self.tree.unlock(handle.lock)
        handle.lock = res.last_node
        shared = handle.committed_len // self.page_size
        if n // self.page_size > shared:  # those pages are the tree's now
            self.budget.hold(handle.rotation, shared, n // self.page_size - shared, -1)
        handle.committed_len = max(handle.committed_len, n)
        if self.lower is not None:
            self.lower.host.on_new_nodes(res.new_nodes)

    @consensus_checked(params=RELEASE_PARAMS, results=())
    def release(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        if handle.state is KVState.READY and len(tokens) < handle.kv_len:
            raise ValueError(f"release of request {handle.rid}: {len(tokens)} tokens for {handle.kv_len} computed")
        if self.lower is not None:
            self.lower.on_release(handle)
        failed = self.restores.leave(handle)  # RESERVED: restores its prefix needed
        # RESERVED: a P/D decode request whose suffix never arrived; kv_len covers only its tree prefix.
        if handle.state in (KVState.READY, KVState.RESERVED):
            kept = 0
            if handle.lock is not None:
                self.cache_prefix(handle, tokens[: handle.kv_len])
                self.tree.unlock(handle.lock)
                kept = handle.committed_len // self.page_size  # the tree's: its full pages, unless refused
                if self.hybrid is not None:  # its turn's end; its own pages' window KV no hit reaches any more
                    self.hybrid.ended(handle.lock, handle.cached.total // self.page_size, kept)
                handle.lock = None
            self._promise(handle, handle.reserved_pages, -1)
            self.budget.hold(handle.rotation, kept, len(handle.pages) - kept, -1)
            self.device.free(handle.pages[kept:])
            handle.table.clear()
            handle.reserved_pages = 0
        # After the handle let go of them: pages a failed restore never wrote.
        self.device.free(self.restores.take_back(failed, self.tree.detach_device))
        handle.enter(KVState.RELEASED)

    # ---- asynchronous results of the lower tiers ----------------------------------------------

    def check(self) -> None:
        if self.lower is not None:
            self.lower.check()

    def before_layer(self) -> Callable[[int], None] | None:
        return self.lower.host.before_layer() if self.lower is not None else None

    @consensus_checked(params=(), results={"pages": lambda ns: sorted(ns["result"].pages)})
    def failed_loads(self) -> FailedLoads:
        return self.lower.host.settle_loads() if self.lower is not None else FailedLoads()

    def drop_failed_loads(self, failed: FailedLoads, requests: int) -> None:
        assert self.lower is not None, "a load failed without a host tier"
        self.lower.drop_failed_loads(failed, requests)

    # ---- maintenance ---------------------------------------------------------------------------

    def flush(self) -> None:
        if self.lower is not None:
            self.lower.drain()  # a backup locks its node until it is taken in
        self.device.evict_all()
        if self.lower is not None:
            self.lower.host.evict_all()  # with what the device's eviction left host-only
        self.tree.reset()

    def leak_report(self) -> list[str]:
        problems = self.device.leak_report() + self.restores.leak_report() + self.budget.leak_report()
        return problems + (self.lower.leak_report() if self.lower is not None else [])

    def usage(self) -> dict[str, tuple[int, int]]:
        lower = {"host": self.lower.host.usage()} if self.lower is not None else {}
        return {"device": self.device.usage(), **lower}

    def resident_bytes(self) -> dict[str, int]:
        lower = {"host": self.lower.host.host.resident_bytes()} if self.lower is not None else {}
        return {"device": self.pool.resident_bytes(), **lower}

    def stats(self) -> CacheStats:
        stats = self.lower.stats() if self.lower is not None else CacheStats()
        if not self.radix:
            return stats
        return dataclasses.replace(stats, retention=self.tree.retention_stats())

    def checked_parts(self) -> list[object]:
        lower = self.lower.checked_parts() if self.lower is not None else []
        return [self, self.device, self.budget, self.tree, *lower]

    def shutdown(self) -> None:
        """Finish the lower tiers' copies in flight and stop their workers."""
        if self.lower is not None:
            self.lower.shutdown()
