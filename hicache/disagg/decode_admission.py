"""P/D disaggregation: decode-side admission, the decode server's use of its own radix tree
(docs/DESIGN.md, "P/D decode reuse", and its worked example, Figure 5) through the request's KV handle.

    reserve:  WAITING ─match─▶ MATCHED ─lock─▶ LOCKED ─budget re-checked─▶ RESERVED  (or back to WAITING)
    complete: RESERVED ─suffix landed and host part restored─▶ READY
    fail:     RESERVED ─▶ RELEASED, every page and lock given back

`reserve` runs the cache's own `PrefixCache.reserve` (the first half of `admit`) over the whole
prompt: it matches decode's tree (device, then host-only nodes; a storage span counts only once its
prefetch has been accepted, i.e. inserted as host nodes), locks the match, re-checks the memory budget
now that the locked prefix can no longer be evicted to make room, and issues the restore of the host
part (the load-back: all or nothing, layer by layer, on the load worker). Then it promises the request
every page it may still need and takes the suffix's pages at once, for the transfer to land in. The
boundary it reports to prefill, `decode_prefix_len`, is the device part plus the restored part:
page-aligned by construction. Restores of different requests are independent operations: each
request waits only for its own.
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
    prompt_len = len(handle.prompt)
    if not cache.enabled:  # decode without a tree: the whole prompt is transferred
        if total_pages > cache.device.available_pages() - cache.reserved_pages:
            return None
        handle.enter(KVState.RESERVED)
        _promise(cache, handle, total_pages, PrefixMatch(), None, prompt_len)
        return Reservation(0, PrefixMatch(), None)
    # The whole prompt: decode computes none of it, so even its last token's KV may come from the tree.
    reserved = cache.reserve(handle, handle.packed_prompt, total_pages)
    if reserved is None:
        return None
    restore = _load_op(cache) if reserved.loaded_nodes else None  # issued just now, runs while the suffix arrives
    _promise(cache, handle, total_pages, reserved.cached, reserved.lock, prompt_len)
    return Reservation(handle.kv_len, reserved.cached, restore, reserved.loaded_nodes)


def _promise(
    cache: PrefixCache, handle: KVHandle, total_pages: int, by_tier: PrefixMatch, lock: TreeNode | None, prompt_len: int
) -> None:
    """Reserve the rest of `total_pages` and take the suffix's pages out of it now (the transfer lands
    in them)."""
    cache.promise(handle, total_pages - len(handle.pages), by_tier, lock)
    cache.extend(handle, prompt_len)


def _load_op(cache: PrefixCache) -> TransferOp | None:
    """The load `_load_back` just queued (it is the last one: this runs on the scheduler thread)."""
    host = getattr(cache, "host", None)  # only the hierarchical cache restores anything
    if host is None:
        return None
    op = host.loads.last()
    host.ledger.claim(op)  # a failed restore fails its request (`fail`), it is not recomputed
    return op


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
    """Take back the device pages a failed restore attached (the host copies stay), so no later match
    reads pages that were never written (RadixTree.detach_device)."""
    cache.device.free(cache.tree.detach_device(nodes))
