"""Decode-side admission on small real pools (hicache/disagg/decode_admission.py): the KV handle's
states on the way to RESERVED, the worked example of docs/DESIGN.md, "P/D decode reuse" (Figure 5: A on
the device, B in host memory, C new: decode restores B and asks only for C), a budget that does not fit
holding nothing, and failure from RESERVED giving every page, lock and promise back, the tree's prefix
kept."""

from __future__ import annotations

import random

from hicache.cache.api import KVState, PrefixMatch
from hicache.cache.hierarchical import HierarchicalCache
from hicache.cache.prefix_cache import PrefixCache
from hicache.config import HiCacheConfig
from hicache.disagg.decode_admission import complete, fail, reserve
from tests.cache.kv import PAGE, assert_kv, device_pool, one_rank, write_kv
from tests.cache.test_hierarchical import serve, settle

A = list(range(10, 10 + 4 * PAGE))  # on decode's device
B = list(range(60, 60 + 4 * PAGE))  # in decode's host memory only
C = list(range(110, 110 + 3 * PAGE + 2))  # new: it must come from prefill


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def decode_cache() -> HierarchicalCache:
    config = HiCacheConfig(enable_hierarchical_cache=True, hicache_load_back_threshold=PAGE)
    return HierarchicalCache(device_pool(16), config, one_rank(), "test-model")


def figure5_state(tmp_path):
    """A decode cache holding A on the device and B (A's continuation) in host memory only."""
    cache = decode_cache()
    serve(cache, 1, A + B + [7])  # caches A + B as one node, backed up to the host (write-through)
    settle(cache)
    cache.tree.match_prefix(A)  # the node is split where A ends
    assert cache.tree.evict(4) == 4  # B, the least recently used device leaf, keeps its host copy
    return cache


def land_and_complete(cache, handle, reservation, prompt):
    """What the transfer does, then decode: the suffix's KV lands, the restore finishes, READY."""
    if reservation.restore is not None:
        reservation.restore.done.wait(10)
    assert reservation.restored()
    write_kv(cache.pool, handle.pages, prompt, start=reservation.decode_prefix_len)
    complete(cache, handle)


def test_figure5_decode_restores_b_and_receives_only_c(tmp_path):
    cache = figure5_state(tmp_path)
    prompt = A + B + C
    handle = cache.open(2, prompt, "")
    res = reserve(cache, handle, pages(len(prompt) + 4))
    assert handle.state is KVState.RESERVED
    assert res.decode_prefix_len == len(A) + len(B), "the reusable boundary is A + B, page-aligned"
    assert res.by_tier == PrefixMatch(device=len(A), host=len(B))
    assert res.restore is not None, "B is restored from host memory"
    assert len(handle.pages) == pages(len(prompt)), "the suffix's pages are taken for the transfer to land in"
    assert handle.kv_len == handle.committed_len == len(A) + len(B)
    assert cache.reserved_pages == handle.reserved_pages == pages(len(prompt) + 4) - pages(len(prompt))
    land_and_complete(cache, handle, res, prompt)
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
    assert reserve(cache, handle, too_many) is None
    assert seen == [KVState.MATCHED, KVState.LOCKED, KVState.WAITING]
    assert handle.state is KVState.WAITING and handle.pages == [] and handle.lock is None
    assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0, "a refused request holds nothing"
    seen.clear()
    res = reserve(cache, handle, pages(len(handle.prompt) + 1))
    assert res is not None and seen == [KVState.MATCHED, KVState.LOCKED, KVState.RESERVED]
    fail(cache, handle, res)
    assert handle.state is KVState.RELEASED


def test_failure_from_reserved_gives_everything_back_and_keeps_the_prefix(tmp_path):
    cache = figure5_state(tmp_path)
    used_before = cache.pool.allocator.used_pages
    handle = cache.open(2, A + B + C, "")
    res = reserve(cache, handle, pages(len(A + B + C) + 4))
    assert res is not None and res.restore is not None
    res.restore.done.wait(10)
    fail(cache, handle, res)  # e.g. prefill went away mid-transfer
    assert handle.state is KVState.RELEASED and handle.pages == [] and handle.reserved_pages == 0
    assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0
    assert cache.pool.allocator.used_pages == used_before + pages(len(B)), "only the restored B stays, cached"
    again = cache.open(3, A + B + C, "")
    res = reserve(cache, again, pages(len(A + B + C) + 4))
    assert res.by_tier == PrefixMatch(device=len(A) + len(B)), "A and the restored B are on the device now"
    land_and_complete(cache, again, res, A + B + C)
    assert_kv(cache.pool, again.pages, A + B + C, "device")
    cache.release(again, A + B + C)
    cache.flush()
    assert cache.leak_report() == []


def test_a_failed_restore_fails_and_leaves_no_unwritten_device_page(tmp_path, monkeypatch):
    cache = figure5_state(tmp_path)
    host_pool = cache.host.host

    def broken(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(host_pool, "load_layer", broken)
    handle = cache.open(2, A + B + C, "")
    res = reserve(cache, handle, pages(len(A + B + C) + 4))
    res.restore.done.wait(10)
    assert res.restored() is False, "the restore failed: decode cannot deliver the prefix it promised"
    fail(cache, handle, res)
    settle(cache)
    assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0
    monkeypatch.undo()
    again = cache.open(3, A + B + C, "")
    res = reserve(cache, again, pages(len(A + B + C) + 4))
    assert res.by_tier == PrefixMatch(device=len(A), host=len(B)), "B is restored afresh, not served unwritten"
    land_and_complete(cache, again, res, A + B + C)
    assert_kv(cache.pool, again.pages, A + B + C, "device + host restore")
    cache.release(again, A + B + C)
    cache.flush()
    assert cache.leak_report() == []


def test_without_a_tree_everything_is_transferred():
    cache = PrefixCache(device_pool(16), enabled=False)
    prompt = A + C
    for rid in range(3):
        handle = cache.open(rid, prompt, "")
        res = reserve(cache, handle, pages(len(prompt) + 2))
        assert res.decode_prefix_len == 0 and res.restore is None and len(handle.pages) == pages(len(prompt))
        land_and_complete(cache, handle, res, prompt)
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
        res = reserve(cache, handle, pages(len(prompt) + 2))
        if res is None:
            assert handle.state is KVState.WAITING
            cache.release(handle, [])
        elif rng.random() < 0.5:
            fail(cache, handle, res)
        else:
            land_and_complete(cache, handle, res, prompt)
            cache.release(handle, prompt)
        settle(cache)
        assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0, f"after request {rid}"
    cache.flush()
    assert cache.leak_report() == []
