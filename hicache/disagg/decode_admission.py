"""P/D disaggregation: decode-side admission, the decode server's use of its own radix tree (section 5
of the seed report, Figure 5) through the request's KV handle.

    reserve:  WAITING ─match─▶ MATCHED ─lock─▶ LOCKED ─budget re-checked─▶ RESERVED  (or back to WAITING)
    complete: RESERVED ─suffix landed and host part restored─▶ READY
    fail:     RESERVED ─▶ RELEASED, every page and lock given back

`reserve` matches the whole prompt in decode's tree (device, then host-only nodes; a storage span
counts only once its prefetch has been accepted, i.e. inserted as host nodes by the cache's own
`_fetched` step), locks the match, re-checks the memory budget now that the locked prefix can no
longer be evicted to make room, and promises the request every page it may still need. It issues the
restore of the host part (the cache's load-back: all or nothing, layer by layer, on the load worker)
and takes device pages for the suffix, into which the transfer lands. The boundary it reports to
prefill, `decode_prefix_len`, is the device part plus the restored part: page-aligned by construction.
Restores of different requests are independent operations: each request waits only for its own.

It runs the same steps as `PrefixCache.admit` through the same hooks, but stops at RESERVED, matches
the last prompt token too (decode computes none of the prompt) and reserves the suffix's pages up front.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.cache.api import KVHandle, KVState, PrefixMatch
from hicache.cache.controller import TransferOp
from hicache.cache.prefix_cache import PrefixCache
from hicache.cache.radix import TreeNode


@dataclass(frozen=True)
class Reservation:
    decode_prefix_len: int  # tokens decode serves from its tree; prefill sends the KV after them
    by_tier: PrefixMatch  # that prefix by the tier it came from (device, host, storage)
    restore: TransferOp | None  # the host part's load, in flight (None when nothing is restored)
    restored_nodes: tuple[TreeNode, ...] = ()  # the host-only nodes it gives device pages

    def restored(self) -> bool | None:
        """True once the restore has landed, None while it runs, False if it failed."""
        if self.restore is None:
            return True
        if not self.restore.done.is_set():
            return None
        return not self.restore.failed


def reserve(cache: PrefixCache, handle: KVHandle, total_pages: int) -> Reservation | None:
    """Promise `handle` the `total_pages` it may ever need (prompt + max new tokens), reusing decode's
    tree; None (handle back to WAITING, holding nothing) when they do not fit now."""
    if handle.state is not KVState.WAITING:
        raise RuntimeError(f"request {handle.rid}: decode admission of a {handle.state.value} handle")
    fetched = cache._fetched(handle)  # an accepted storage prefetch becomes host nodes before the match
    prompt_len = len(handle.prompt)
    if not cache.enabled:  # decode without a tree: the whole prompt is transferred
        if total_pages > cache.device.available_pages() - cache.reserved_pages:
            return None
        handle.enter(KVState.RESERVED)
        _promise(cache, handle, total_pages, PrefixMatch(), None, prompt_len)
        return Reservation(0, PrefixMatch(), None)
    match = cache.tree.match_prefix(handle.prompt, handle.namespace, count_hit=True)
    handle.enter(KVState.MATCHED)
    cache.tree.lock(match.last_node)  # also keeps the host-only continuation from host eviction
    handle.enter(KVState.LOCKED)
    # Re-checked after locking: the locked prefix no longer counts as evictable room.
    need = total_pages - len(match.device_pages)
    if need > cache.device.available_pages() - cache.reserved_pages:
        cache.tree.unlock(match.last_node)
        handle.enter(KVState.WAITING)
        return None
    handle.enter(KVState.RESERVED)
    handle.pages = list(match.device_pages)
    restored_pages = cache._load_back(match, need)  # the restore, issued now, runs while the suffix arrives
    restore = _load_op(cache) if restored_pages else None
    handle.pages.extend(restored_pages)
    deepest = match.host_nodes[-1] if restored_pages else match.last_device_node
    cache.tree.lock(deepest)
    cache.tree.unlock(match.last_node)
    first = len(match.device_pages)
    in_storage = range(max(first, fetched.start), min(first + len(restored_pages), fetched.stop))
    by_tier = PrefixMatch(
        device=match.num_tokens,
        host=(len(restored_pages) - len(in_storage)) * cache.page_size,
        storage=len(in_storage) * cache.page_size,
    )
    handle.kv_len = handle.committed_len = len(handle.pages) * cache.page_size  # those pages are the tree's
    _promise(cache, handle, total_pages, by_tier, deepest, prompt_len)
    return Reservation(handle.kv_len, by_tier, restore, tuple(match.host_nodes) if restored_pages else ())


def _promise(
    cache: PrefixCache, handle: KVHandle, total_pages: int, by_tier: PrefixMatch, lock: TreeNode | None, prompt_len: int
) -> None:
    """Reserve the rest of `total_pages` and take the suffix's pages out of it now (the transfer lands
    in them), as `PrefixCache.extend` would."""
    handle.reserved_pages = total_pages - len(handle.pages)
    cache.reserved_pages += handle.reserved_pages
    handle.cached = by_tier
    handle.lock = lock
    want = -(-prompt_len // cache.page_size) - len(handle.pages)
    if want > 0:
        handle.pages.extend(cache.alloc(want))
        handle.reserved_pages -= want
        cache.reserved_pages -= want


def _load_op(cache: PrefixCache) -> TransferOp | None:
    """The load `_load_back` just queued (it is the last one: this runs on the scheduler thread)."""
    host = getattr(cache, "host", None)  # only the hierarchical cache restores anything
    return host.loads.last() if host is not None else None


def complete(cache: PrefixCache, handle: KVHandle) -> None:
    """RESERVED → READY: the whole prompt's KV is in the handle's pages; share it through the tree."""
    handle.enter(KVState.READY)
    handle.advance(len(handle.prompt))
    if handle.lock is not None:
        cache._on_admitted(handle)
    cache.cache_prefix(handle, handle.prompt)


def fail(cache: PrefixCache, handle: KVHandle, reservation: Reservation | None = None) -> None:
    """RESERVED (or still WAITING) → RELEASED: unlock, free the suffix's pages, return the promise.
    The prefix stays in the tree (its pages were the tree's all along), except device copies a failed
    restore never filled."""
    cache.release(handle, handle.prompt[: handle.kv_len])
    if reservation is not None and reservation.restored() is False:
        _drop_unfilled(cache, reservation.restored_nodes)


def _drop_unfilled(cache: PrefixCache, nodes: tuple[TreeNode, ...]) -> None:
    """Take back the device pages a failed restore attached (the host copies stay), deepest first and
    only where nobody else holds them, so no later match reads pages that were never written. This is
    device eviction of host-backed nodes (RadixTree.evict) aimed at these nodes."""
    for node in reversed(nodes):
        if node.device_pages is None or node.lock_ref > 0 or any(c.on_device for c in node.children.values()):
            return
        pages, node.device_pages = node.device_pages, None
        cache.tree.evictable_pages -= len(pages)
        cache.device.free(pages)
