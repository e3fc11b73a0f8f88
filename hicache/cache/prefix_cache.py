"""The radix prefix cache behind the cache API (docs/DESIGN.md, "cache API"): it owns the requests' KV
handles and the reservations, and runs admission over the device tier. `HierarchicalCache`
(hierarchical.py) adds the host and storage tiers through the hooks marked below.

Lease contract: a READY handle holds exactly one tree lock (`handle.lock`) until it is released;
moving it deeper (after its prompt is cached) locks the new node before unlocking the old one.

NOTE (memory invariant): a request is admitted only if the pages it may ever need (prompt + max new
tokens, less its cached prefix) fit in free + evictable pages minus what admitted requests were
promised (`reserved_pages`); so a READY handle can always `extend`, evicting unlocked cache if needed,
and never runs out of KV memory mid-way. With sharded pages this holds per owner class
(`reserved_by_class`; the handle's pages cycle through the classes from its `rotation`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from hicache.cache.api import Admission, KVHandle, KVState, PrefixMatch, RestoreStatus
from hicache.cache.device_tier import DeviceTier
from hicache.cache.failed_loads import FailedLoads, IssuedLoad
from hicache.cache.gather_budget import GatherBudget
from hicache.cache.page_keys import Tokens
from hicache.cache.radix import MatchResult, PagesFn, TreeNode
from hicache.cache.restores import Restores
from hicache.cache.stats import CacheStats
from hicache.debug.consensus_checker import consensus_checked
from hicache.mem.device_pool import DeviceKVPool

logger = logging.getLogger(__name__)

# What must agree across ranks about an admission: its inputs, the decision, the matched length by tier.
ADMIT_PARAMS = {"rid": "handle.rid", "total_pages": "total_pages", "reserved_elsewhere": "self.reserved_pages"}
ADMIT_RESULTS = {
    "result": "result.admitted",
    "kv_len": "handle.kv_len",
    "cached_tokens_by_tier": "handle.cached_tokens_by_tier",
    "reserved_pages": "handle.reserved_pages",
}
RELEASE_PARAMS = {"rid": "handle.rid", "kv_len": "handle.kv_len"}

NO_PAGES = range(0)


@dataclass(frozen=True)
class Reserved:
    """What `PrefixCache._reserve_prefix` matched and locked."""

    cached: PrefixMatch  # the reused prefix by the tier that holds it
    lock: TreeNode  # the deepest node of that prefix, locked for the handle
    load: IssuedLoad | None  # the load of its host-only part back to the device (None: nothing loads)


class PrefixCache:
    def __init__(
        self, pool: DeviceKVPool, enabled: bool = True, on_host_free: PagesFn | None = None, draft: bool = False
    ) -> None:
        """`draft`: a speculative draft's pools share the device pages (hicache/spec/): handles then
        track the draft's length beside the target's (`KVHandle.draft_len`)."""
        self.draft = draft
        self.device = DeviceTier(pool, on_host_free, evict=enabled)
        self.pool = pool
        self.page_size = pool.page_size
        self.tree = self.device.tree
        self.enabled = enabled
        self.reserved_pages = 0  # promised to READY handles, not yet allocated by them
        self.reserved_by_class = [0] * pool.allocator.num_classes
        self.gather = GatherBudget(pool, self.tree)  # the CP gather's scratch (sharded pages only)
        self.restores = Restores()  # what `reserve` restores (the hierarchical cache gives it its ledger)

    # ---- hooks for the hierarchical tiers ------------------------------------------------------

    def _on_open(self, handle: KVHandle) -> None:
        """A request arrived (a storage tier starts its prefetch)."""

    def _fetched(self, handle: KVHandle) -> range:
        """Just before matching: prompt pages a storage prefetch has put on the host for this request."""
        return NO_PAGES

    def _load_back(self, match: MatchResult, budget: int) -> IssuedLoad | None:
        """The load of the whole host-resident part of `match` into device pages (all or nothing: None
        when it is not worth it or more than `budget` pages). The device tier has nothing to load."""
        return None

    def _on_admitted(self, handle: KVHandle) -> None:
        """The handle is READY, its prefix locked (selective write-through backs up hot nodes)."""

    def _on_new_nodes(self, nodes: list[TreeNode]) -> None:
        """Nodes were just created on the device tier (write-through backs them up)."""

    def _keep_on_evict(self, node: TreeNode) -> bool:
        """Called for a node leaving the device without a host copy; True if it was backed up now."""
        return False

    def _on_release(self, handle: KVHandle) -> None:
        """The request went away (a prefetch still running for it is cancelled)."""

    def _draft_unrestored(self, handle: KVHandle) -> int:
        """Tokens of the handle's cached prefix whose draft state was not restored with the target's
        (every pool of a device page holds its state: nothing, on the device tier)."""
        return 0

    def ready_to_admit(self, handle: KVHandle, busy: bool) -> bool:
        return True

    def check(self) -> None:
        """Consume completed asynchronous transfers (a scheduler check point)."""

    def before_layer(self) -> Callable[[int], None] | None:
        return None

    def failed_loads(self) -> FailedLoads:
        return FailedLoads()  # nothing loads without a host tier

    def drop_failed_loads(self, failed: FailedLoads, requests: int) -> None:
        pass

    # ---- a handle's life -----------------------------------------------------------------------

    def open(self, rid: int, prompt: Sequence[int], namespace: str) -> KVHandle:
        handle = KVHandle(rid, prompt, namespace, self.page_size, draft_len=0 if self.draft else None)
        self._on_open(handle)
        return handle

    def lookup(self, prompt: Sequence[int], namespace: str) -> PrefixMatch:
        # The prefix admission matches (`admit`): all of the prompt but its last token.
        peek = self.tree.peek(prompt[: len(prompt) - 1], namespace)
        return PrefixMatch(device=peek.device_tokens, host=peek.host_tokens)

    @consensus_checked(params=ADMIT_PARAMS, results=ADMIT_RESULTS)
    def admit(self, handle: KVHandle, total_pages: int) -> Admission:
        if handle.state is not KVState.WAITING:
            raise RuntimeError(f"request {handle.rid}: admission of a {handle.state.value} handle")
        if not self.enabled:
            if not self._reserve_without_tree(handle, total_pages):
                return Admission(False)
            return self._ready(handle, total_pages, PrefixMatch(), None)
        if self.restores.blocks_admission():
            return Admission(False)  # a hit on a restore's pages would read them before they land
        # At least the last prompt token is always computed: its logits give the first output token.
        reserved = self._reserve_prefix(handle, handle.packed_prompt.view(len(handle.prompt) - 1), total_pages)
        if reserved is None:
            return Admission(False)
        admission = self._ready(handle, total_pages - len(handle.pages), reserved.cached, reserved.lock)
        self._on_admitted(handle)
        return admission

    @consensus_checked(params=ADMIT_PARAMS, results=ADMIT_RESULTS)
    def reserve(self, handle: KVHandle, total_pages: int) -> Admission:
        if handle.state is not KVState.WAITING:
            raise RuntimeError(f"request {handle.rid}: reservation of a {handle.state.value} handle")
        cached, lock = PrefixMatch(), None
        if not self.enabled:  # without a tree the whole prompt's KV comes from outside
            if not self._reserve_without_tree(handle, total_pages):
                return Admission(False)
        else:
            reserved = self._reserve_prefix(handle, handle.packed_prompt, total_pages)
            if reserved is None:
                return Admission(False)
            self.restores.track(handle, reserved.load)
            cached, lock = reserved.cached, reserved.lock
        self._reserve_rest(handle, total_pages - len(handle.pages), cached, lock)
        self.extend(handle, len(handle.prompt))  # the pages the outside KV lands in
        return Admission(True, cached, handle.reserved_pages)

    def restore_status(self, handle: KVHandle) -> RestoreStatus:
        return self.restores.status(handle)

    def complete(self, handle: KVHandle) -> None:
        if handle.state is not KVState.RESERVED:
            raise RuntimeError(f"request {handle.rid}: completion of a {handle.state.value} handle")
        self.restores.landed(handle)
        handle.enter(KVState.READY)
        handle.advance(len(handle.prompt))
        if handle.lock is not None:
            self._on_admitted(handle)
        self.cache_prefix(handle, handle.prompt)

    def fail(self, handle: KVHandle) -> None:
        self.release(handle, handle.prompt[: handle.kv_len])  # the prefix's pages were the tree's all along

    def _reserve_without_tree(self, handle: KVHandle, total_pages: int) -> bool:
        """WAITING → RESERVED with nothing cached (radix cache off), if `total_pages` fit; else False."""
        handle.rotation = self.device.new_rotation()
        if not self._room(handle, 0, total_pages):
            return False
        handle.enter(KVState.RESERVED)
        return True

    def _reserve_prefix(self, handle: KVHandle, tokens: Tokens, total_pages: int) -> Reserved | None:
        """WAITING → MATCHED → LOCKED → RESERVED over the cached prefix of `tokens`: match it (a finished
        prefetch is inserted first), lock it, and, if the `total_pages` less its device part fit in
        free + evictable pages minus what others were promised (checked with the prefix locked), start
        loading its host part back; else back to WAITING holding nothing (None). The handle then holds
        the prefix's pages (kv_len = committed_len = their tokens) and one lock, on `Reserved.lock`;
        promising the rest is the caller's: `admit` goes on to READY, `reserve` stops here while the
        rest of the prompt's KV arrives from outside. Changes the tree: yes."""
        fetched = self._fetched(handle)
        match = self.tree.match_prefix(tokens, handle.namespace, count_hit=True)
        handle.enter(KVState.MATCHED)
        self.tree.lock(match.last_node)  # also keeps a host-resident continuation from host eviction
        handle.enter(KVState.LOCKED)
        handle.rotation = match.rotation if match.rotation is not None else self.device.new_rotation()
        need = total_pages - len(match.device_pages)
        if not self._room(handle, len(match.device_pages), need):
            self.tree.unlock(match.last_node)
            handle.enter(KVState.WAITING)
            return None
        handle.enter(KVState.RESERVED)
        handle.pages = list(match.device_pages)
        load = self._load_back(match, need) if handle.load_host else None
        loaded = load.device_pages if load is not None else []
        handle.pages.extend(loaded)
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

    def _room(self, handle: KVHandle, first: int, n: int) -> bool:
        """Whether pages first..first+n-1 of the handle's prefix fit, class by class, in the pool and in
        the gather's scratch."""
        classes = self.device.classes(handle.rotation, first, n)
        return self.device.room(classes, self.reserved_by_class) and self.gather.fits(classes, self.reserved_by_class)

    def _promise(self, handle: KVHandle, n: int, sign: int) -> None:
        """Count (sign +1) or uncount (-1) the handle's next n pages, from len(pages) on, as promised."""
        self.reserved_pages += sign * n
        for c in self.device.classes(handle.rotation, len(handle.pages), n):
            self.reserved_by_class[c] += sign

    def _reserve_rest(self, handle: KVHandle, reserve: int, cached: PrefixMatch, lock: TreeNode | None) -> None:
        """Promise the handle `reserve` more pages (counted against admission, by owner class) and
        record its cached prefix and lock: what `admit` and `reserve` do after matching."""
        handle.reserved_pages = reserve
        handle.cached = cached
        handle.lock = lock
        self._promise(handle, reserve, +1)

    def _ready(self, handle: KVHandle, reserve: int, cached: PrefixMatch, lock: TreeNode | None) -> Admission:
        self._reserve_rest(handle, reserve, cached, lock)
        if handle.draft_len is not None:  # the effective hit is the MIN over every pool it needs
            handle.draft_len = handle.kv_len - self._draft_unrestored(handle)
        handle.enter(KVState.READY)
        return Admission(True, cached, reserve)

    def extend(self, handle: KVHandle, end: int) -> None:
        want = -(-end // self.page_size) - len(handle.pages)
        if want <= 0:
            return
        if want > handle.reserved_pages:
            raise RuntimeError("KV reservation invariant broken: a request outgrew its reservation")
        self._promise(handle, want, -1)
        self.gather.hold(handle.rotation, len(handle.pages), want, +1)
        classes = self.device.classes(handle.rotation, len(handle.pages), want)
        handle.pages.extend(self.device.alloc(want, keep_if=self._keep_on_evict, classes=classes))
        handle.reserved_pages -= want

    def alloc(self, n: int, classes: Sequence[int] | None = None) -> list[int]:
        """n device pages (of `classes`) outside any reservation's accounting (a load-back's, which
        admission counted)."""
        return self.device.alloc(n, keep_if=self._keep_on_evict, classes=classes)

    def cache_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        n = len(tokens) - len(tokens) % self.page_size
        if not self.enabled or n == 0:
            return
        # `tokens` is the request's sequence, its prompt first: the prompt is packed once per request
        # and only what follows it (the output, at release) is converted here.
        key = handle.packed_prompt.prefix_of(tokens, n)
        res = self.device.insert(key, handle.pages[: n // self.page_size], handle.namespace, handle.rotation)
        if res.refused:  # another placement of these tokens is cached: this request keeps its own pages
            return
        handle.pages[: len(res.pages)] = res.pages
        self.tree.lock(res.last_node)
        assert handle.lock is not None
        self.tree.unlock(handle.lock)
        handle.lock = res.last_node
        shared = handle.committed_len // self.page_size
        if n // self.page_size > shared:  # those pages are the tree's now
            self.gather.hold(handle.rotation, shared, n // self.page_size - shared, -1)
        handle.committed_len = max(handle.committed_len, n)
        self._on_new_nodes(res.new_nodes)

    @consensus_checked(params=RELEASE_PARAMS, results=())
    def release(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        if handle.state is KVState.READY and len(tokens) < handle.kv_len:
            raise ValueError(f"release of request {handle.rid}: {len(tokens)} tokens for {handle.kv_len} computed")
        self._on_release(handle)
        failed = self.restores.leave(handle)  # RESERVED: restores its prefix needed
        # RESERVED: a P/D decode request whose suffix never arrived; kv_len covers only its tree prefix.
        if handle.state in (KVState.READY, KVState.RESERVED):
            kept = 0
            if self.enabled and handle.lock is not None:
                self.cache_prefix(handle, tokens[: handle.kv_len])
                self.tree.unlock(handle.lock)
                handle.lock = None
                kept = handle.committed_len // self.page_size  # the tree's: its full pages, unless refused
            self._promise(handle, handle.reserved_pages, -1)
            self.gather.hold(handle.rotation, kept, len(handle.pages) - kept, -1)
            self.device.free(handle.pages[kept:])
            handle.pages = []
            handle.reserved_pages = 0
        # After the handle let go of them: pages a failed restore never wrote.
        self.device.free(self.restores.take_back(failed, self.tree.detach_device))
        handle.enter(KVState.RELEASED)

    # ---- maintenance ---------------------------------------------------------------------------

    def flush(self) -> None:
        self.check()
        self.device.evict_all()
        self.tree.reset()

    def leak_report(self) -> list[str]:
        problems = self.device.leak_report() + self.restores.leak_report()
        if self.reserved_pages:
            problems.append(f"{self.reserved_pages} pages still reserved")
        if any(self.gather.private_by_class):
            problems.append(f"pages still counted as requests' own: {self.gather.private_by_class}")
        return problems

    def usage(self) -> dict[str, tuple[int, int]]:
        return {"device": self.device.usage()}

    def resident_bytes(self) -> dict[str, int]:
        return {"device": self.pool.resident_bytes()}

    def stats(self) -> CacheStats:
        return CacheStats()

    def checked_parts(self) -> list[object]:
        return [self, self.device, self.tree]

    def shutdown(self) -> None:
        """Stop background work (the hierarchical tiers' workers)."""
