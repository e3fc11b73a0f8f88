"""The device tier alone: allocation evicts unlocked cache least recently used first and never a
locked prefix, an insert that finds its tokens cached returns the duplicate pages, and the write-back
hook decides what stays as host-only."""

from __future__ import annotations

import pytest

from hicache.cache.device_tier import DeviceTier
from tests.cache.kv import PAGE, device_pool

A = list(range(2 * PAGE))
B = list(range(100, 100 + 2 * PAGE))


def cached(device: DeviceTier, tokens: list[int]) -> list[int]:
    pages = device.alloc(len(tokens) // PAGE)
    return device.insert(tokens, pages, "").pages


def test_alloc_evicts_least_recently_used_first():
    device = DeviceTier(device_pool(6))
    cached(device, A)
    cached(device, B)
    device.tree.match_prefix(A)  # A is now the more recent
    assert device.available_pages() == 6
    device.alloc(3)  # 2 free: one of B's pages must go
    assert device.tree.match_prefix(B).num_tokens == 0, "device tier: the least recently used prefix was kept"
    assert device.tree.match_prefix(A).num_tokens == len(A), "device tier: the recently used prefix was evicted"


def test_a_locked_prefix_is_never_evicted():
    device = DeviceTier(device_pool(4))
    cached(device, A)
    node = device.tree.match_prefix(A).last_node
    device.tree.lock(node)
    assert device.available_pages() == 2
    with pytest.raises(RuntimeError, match="reservation invariant"):
        device.alloc(3)
    assert device.tree.match_prefix(A).num_tokens == len(A)
    device.tree.unlock(node)
    device.alloc(4)
    assert device.tree.match_prefix(A).num_tokens == 0


def test_insert_of_cached_tokens_returns_the_duplicates():
    device = DeviceTier(device_pool(8))
    first = cached(device, A)
    mine = device.alloc(2)
    res = device.insert(A + B[:PAGE], mine + device.alloc(1), "")
    assert res.pages[:2] == first, "the tree's pages win"
    assert device.allocator.used_pages == 3, "our duplicates went back to the pool"
    assert len(res.new_nodes) == 1 and tuple(res.last_node.tokens) == tuple(B[:PAGE])


def test_keep_if_decides_what_eviction_keeps():
    device = DeviceTier(device_pool(4))
    cached(device, A)
    seen = []

    def keep(node):
        seen.append(node)
        node.host_pages = [0, 1]  # as a write-back would
        return True

    device.alloc(4, keep_if=keep)
    assert len(seen) == 1
    match = device.tree.match_prefix(A)
    assert match.num_tokens == 0 and match.host_tokens == len(A), "the node stays, host-only"


def test_no_eviction_with_the_radix_cache_off():
    device = DeviceTier(device_pool(4), evict=False)
    cached(device, A)
    with pytest.raises(RuntimeError):
        device.alloc(3)


def test_leak_report_and_usage():
    device = DeviceTier(device_pool(4))
    cached(device, A)
    assert device.usage() == (2 * PAGE, 4 * PAGE)
    assert device.leak_report() == ["2 device pages not freed"]
    device.evict_all()
    device.tree.reset()
    assert device.leak_report() == [] and device.usage() == (0, 4 * PAGE)
