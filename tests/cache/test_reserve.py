"""Admission for KV written from outside on small real pools (`KVCache.reserve` / `complete` / `fail`,
a P/D decode server's door into its own tree): the KV handle's states on the way to RESERVED, the worked
example of docs/DESIGN.md, "P/D decode reuse" (Figure 5: A on the device, B in host memory, C new:
decode restores B and asks only for C), a budget that does not fit holding nothing, and failure from
RESERVED giving every page, lock and promise back, the tree's prefix kept."""

from __future__ import annotations

import random
import threading
import time

from hicache.cache.api import KVState, PrefixMatch, RestoreState
from hicache.cache.build import device_cache, hierarchical_cache
from hicache.cache.prefix_cache import PrefixCache
from hicache.config import HiCacheConfig
from tests.cache.kv import PAGE, assert_kv, device_pool, one_rank, write_kv
from tests.cache.test_hierarchical import serve, settle

A = list(range(10, 10 + 4 * PAGE))  # on decode's device
B = list(range(60, 60 + 4 * PAGE))  # in decode's host memory only
C = list(range(110, 110 + 3 * PAGE + 2))  # new: it must come from prefill


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def decode_cache(device_pages: int = 16) -> PrefixCache:
    config = HiCacheConfig(enable_hierarchical_cache=True, hicache_load_back_threshold=PAGE)
    return hierarchical_cache(device_pool(device_pages), config, one_rank(), "test-model")


def figure5_state(tmp_path):
    """A decode cache holding A on the device and B (A's continuation) in host memory only."""
    cache = decode_cache()
    serve(cache, 1, A + B + [7])  # caches A + B as one node, backed up to the host (write-through)
    settle(cache)
    cache.tree.match_prefix(A)  # the node is split where A ends
    assert cache.tree.evict(4) == 4  # B, the least recently used device leaf, keeps its host copy
    return cache


def restoring(cache, handle) -> bool:
    """Whether the handle's prefix needs a restore (its own, or one it shares)."""
    return bool(cache.restores.needs.get(handle.rid))


def restore_done(cache, handle) -> RestoreState:
    """The restore status once nothing it needs is still copying."""
    deadline = time.monotonic() + 10
    while (state := cache.restore_status(handle).state) is RestoreState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.005)
    return state


def land_and_complete(cache, handle, prompt):
    """What the transfer does, then decode: the suffix's KV lands, the restore finishes, READY."""
    assert restore_done(cache, handle) is RestoreState.LANDED
    write_kv(cache.pool, handle.pages, prompt, start=handle.kv_len)
    cache.complete(handle)


def test_figure5_decode_restores_b_and_receives_only_c(tmp_path):
    cache = figure5_state(tmp_path)
    prompt = A + B + C
    handle = cache.open(2, prompt, "")
    res = cache.reserve(handle, pages(len(prompt) + 4))
    assert handle.state is KVState.RESERVED
    assert handle.kv_len == len(A) + len(B), "the reusable boundary is A + B, page-aligned"
    assert res.cached == PrefixMatch(device=len(A), host=len(B))
    assert restoring(cache, handle), "B is restored from host memory"
    assert len(handle.pages) == pages(len(prompt)), "the suffix's pages are taken for the transfer to land in"
    assert handle.kv_len == handle.committed_len == len(A) + len(B)
    assert cache.reserved_pages == handle.reserved_pages == pages(len(prompt) + 4) - pages(len(prompt))
    land_and_complete(cache, handle, prompt)
    assert handle.state is KVState.READY and handle.kv_len == len(prompt)
    assert_kv(cache.pool, handle.pages, prompt, "device (A) + host restore (B) + transfer (C)")
    cache.release(handle, prompt)
    settle(cache)
    assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0
    cache.flush()
    assert cache.leak_report() == []


def test_the_states_on_the_way_and_a_budget_that_does_not_fit(tmp_path):
    cache = figure5_state(tmp_path)
    handle = cache.open(2, A + B + C, "")
    seen = []
    original = handle.enter
    handle.enter = lambda state: (seen.append(state), original(state))  # type: ignore[method-assign]
    too_many = cache.pool.allocator.num_pages + 1
    assert not cache.reserve(handle, too_many).admitted
    assert seen == [KVState.MATCHED, KVState.LOCKED, KVState.WAITING]
    assert handle.state is KVState.WAITING and handle.pages == [] and handle.lock is None
    assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0, "a refused request holds nothing"
    seen.clear()
    res = cache.reserve(handle, pages(len(handle.prompt) + 1))
    assert res.admitted and seen == [KVState.MATCHED, KVState.LOCKED, KVState.RESERVED]
    cache.fail(handle)
    assert handle.state is KVState.RELEASED


def test_failure_from_reserved_gives_everything_back_and_keeps_the_prefix(tmp_path):
    cache = figure5_state(tmp_path)
    used_before = cache.pool.allocator.used_pages
    handle = cache.open(2, A + B + C, "")
    res = cache.reserve(handle, pages(len(A + B + C) + 4))
    assert res.admitted and restoring(cache, handle)
    restore_done(cache, handle)
    cache.fail(handle)  # e.g. prefill went away mid-transfer
    assert handle.state is KVState.RELEASED and handle.pages == [] and handle.reserved_pages == 0
    assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0
    assert cache.pool.allocator.used_pages == used_before + pages(len(B)), "only the restored B stays, cached"
    again = cache.open(3, A + B + C, "")
    res = cache.reserve(again, pages(len(A + B + C) + 4))
    assert res.cached == PrefixMatch(device=len(A) + len(B)), "A and the restored B are on the device now"
    land_and_complete(cache, again, A + B + C)
    assert_kv(cache.pool, again.pages, A + B + C, "device")
    cache.release(again, A + B + C)
    cache.flush()
    assert cache.leak_report() == []


def test_a_failed_restore_fails_and_leaves_no_unwritten_device_page(tmp_path, monkeypatch):
    cache = figure5_state(tmp_path)
    host_pool = cache.lower.host.host

    def broken(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(host_pool, "load_layer", broken)
    handle = cache.open(2, A + B + C, "")
    cache.reserve(handle, pages(len(A + B + C) + 4))
    failed = "the restore failed: decode cannot deliver the prefix it promised"
    assert restore_done(cache, handle) is RestoreState.FAILED, failed
    cache.fail(handle)
    settle(cache)
    assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0
    monkeypatch.undo()
    again = cache.open(3, A + B + C, "")
    res = cache.reserve(again, pages(len(A + B + C) + 4))
    assert res.cached == PrefixMatch(device=len(A), host=len(B)), "B is restored afresh, not served unwritten"
    land_and_complete(cache, again, A + B + C)
    assert_kv(cache.pool, again.pages, A + B + C, "device + host restore")
    cache.release(again, A + B + C)
    cache.flush()
    assert cache.leak_report() == []


def test_without_a_tree_everything_is_transferred():
    cache = device_cache(device_pool(16), radix=False)
    prompt = A + C
    for rid in range(3):
        handle = cache.open(rid, prompt, "")
        cache.reserve(handle, pages(len(prompt) + 2))
        assert handle.kv_len == 0 and not restoring(cache, handle) and len(handle.pages) == pages(len(prompt))
        land_and_complete(cache, handle, prompt)
        assert_kv(cache.pool, handle.pages, prompt, "transfer")
        cache.release(handle, prompt)
    assert cache.leak_report() == [] and cache.pool.allocator.used_pages == 0


def test_locks_and_promises_balance_over_random_successes_and_failures(tmp_path):
    cache = decode_cache()
    rng = random.Random(0)
    spans = [A, B, C]
    for rid in range(40):
        prompt = [t for span in rng.sample(spans, rng.randint(1, 3)) for t in span] + [rng.randrange(200, 250)]
        handle = cache.open(rid, prompt, "")
        res = cache.reserve(handle, pages(len(prompt) + 2))
        if not res.admitted:
            assert handle.state is KVState.WAITING
            cache.release(handle, [])
        elif rng.random() < 0.5:
            cache.fail(handle)
        else:
            land_and_complete(cache, handle, prompt)
            cache.release(handle, prompt)
        settle(cache)
        assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0, f"after request {rid}"
    cache.flush()
    assert cache.leak_report() == []


X = list(range(160, 160 + 4 * PAGE))  # a second prefix, also in decode's host memory only


def two_restorable_prefixes():
    """A decode cache holding A on the device, and A + B and X + [7] backed up then pushed to host only."""
    cache = decode_cache(device_pages=40)
    serve(cache, 1, A + B + [7])
    serve(cache, 2, X + [7])
    settle(cache)
    cache.tree.match_prefix(A)  # the node is split where A ends
    assert cache.tree.evict(8) == 8  # B and X leave the device, keeping their host copies
    return cache


def test_a_failed_restore_fails_only_the_requests_whose_prefix_needs_it(monkeypatch):
    cache = two_restorable_prefixes()
    running = cache.open(3, A + [9, 9], "")  # a request decoding from A meanwhile, READY
    cache.reserve(running, pages(len(A) + 4))
    land_and_complete(cache, running, A + [9, 9])
    b_host_pages = list(cache.tree.match_prefix(A + B).host_pages)
    gate = threading.Event()
    real = cache.lower.host.host.load_layer

    def b_fails(pool, layer, host_pages, device_pages):
        if list(host_pages) == b_host_pages:
            assert gate.wait(10)
            raise RuntimeError("injected copy failure of B")
        real(pool, layer, host_pages, device_pages)

    monkeypatch.setattr(cache.lower.host.host, "load_layer", b_fails)
    other = cache.open(6, X + C, "")  # restores X, which lands (first: one worker runs the loads in turn)
    assert cache.reserve(other, pages(len(X + C) + 4)).cached == PrefixMatch(host=len(X))
    assert restore_done(cache, other) is RestoreState.LANDED
    owner = cache.open(4, A + B + C, "")  # restores B
    assert cache.reserve(owner, pages(len(A + B + C) + 4)).cached == PrefixMatch(device=len(A), host=len(B))
    sharer = cache.open(5, A + B + [8], "")  # reserved while B is still copying: its prefix reads B's pages
    assert cache.reserve(sharer, pages(len(A + B) + 4)).cached == PrefixMatch(device=len(A) + len(B))
    assert cache.restore_status(owner).state is RestoreState.RUNNING, "B's copy is held back"
    assert cache.before_layer() is None, "a step of the running request waits for no restore"
    gate.set()
    assert restore_done(cache, owner) is RestoreState.FAILED
    assert "injected copy failure of B" in (cache.restore_status(owner).error or "")
    assert cache.restore_status(sharer).state is RestoreState.FAILED, "it holds pages B's restore never wrote"
    land_and_complete(cache, other, X + C)
    assert_kv(cache.pool, other.pages, X + C, "host restore (X) + transfer (C)")
    assert_kv(cache.pool, running.pages, A + [9, 9], "device")
    cache.fail(owner)
    assert cache.tree.match_prefix(A + B).host_tokens == 0, "B stays on the device while a handle holds it"
    cache.fail(sharer)
    assert cache.tree.match_prefix(A + B).host_tokens == len(B), "B is host-only again, its device pages back"
    monkeypatch.undo()
    for handle, prompt in ((running, A + [9, 9]), (other, X + C)):
        cache.release(handle, prompt)
    again = cache.open(7, A + B + C, "")
    assert cache.reserve(again, pages(len(A + B + C) + 4)).cached == PrefixMatch(device=len(A), host=len(B))
    land_and_complete(cache, again, A + B + C)
    assert_kv(cache.pool, again.pages, A + B + C, "device + host restore, afresh")
    cache.release(again, A + B + C)
    settle(cache)
    cache.flush()
    assert cache.leak_report() == []
    cache.shutdown()


def test_admission_waits_while_a_restore_is_in_the_book():
    cache = two_restorable_prefixes()
    decoding = cache.open(3, A + B + C, "")
    cache.reserve(decoding, pages(len(A + B + C) + 4))
    plain = cache.open(4, A + B + [5], "")
    assert not cache.admit(plain, pages(len(A + B) + 4)).admitted, "a hit on B's pages would read them mid-copy"
    assert plain.state is KVState.WAITING and plain.pages == []
    land_and_complete(cache, decoding, A + B + C)
    assert cache.admit(plain, pages(len(A + B) + 4)).cached == PrefixMatch(device=len(A) + len(B))
    for handle, prompt in ((decoding, A + B + C), (plain, A + B)):
        cache.release(handle, prompt)
    cache.flush()
    assert cache.leak_report() == []
    cache.shutdown()
