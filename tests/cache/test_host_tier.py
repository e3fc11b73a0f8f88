"""The host tier with small real pools: each write policy backs up when it says, a backup holds the
device bytes, a failed backup becomes a miss, load-back is all or nothing and restores the bytes, and
layer events let layer i go as soon as layer i has landed."""

from __future__ import annotations

import threading

import pytest

from hicache.cache.host_tier import HostTier, WritePolicy, host_pool_pages
from hicache.config import WRITE_POLICIES, HiCacheConfig
from hicache.mem.host_pool import LAYOUTS, HostKVPool
from tests.cache.kv import LAYERS, PAGE, assert_host_kv, assert_kv, compute, device_pool, settle, tiers

A = list(range(3 * PAGE))


def evict_to_host(device, host: HostTier) -> None:
    device.alloc(device.allocator.num_pages, keep_if=host.write_back)
    device.allocator.free(list(range(device.allocator.num_pages)))


def test_policies_match_the_flag_values():
    assert tuple(p.value for p in WritePolicy) == WRITE_POLICIES


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_through_backs_up_at_creation(layout):
    device, host = tiers(policy=WritePolicy.WRITE_THROUGH, layout=layout)
    nodes = compute(device, A)
    host.on_new_nodes(nodes)
    assert nodes[0].backup_pending and nodes[0].lock_ref == 1, "host tier: a backup in flight locks its node"
    finished = settle(host)
    assert finished == nodes and nodes[0].backed_up and nodes[0].lock_ref == 0
    assert_host_kv(host.host, nodes[0].host_pages, A, "host")
    assert host.stats.backup_pages == 3 and host.stats.backup_bytes == 3 * host.host.page_bytes


def test_write_through_selective_backs_up_at_the_second_hit():
    device, host = tiers(policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    nodes = compute(device, A)
    host.on_new_nodes(nodes)
    path = device.tree.path_to_root(device.tree.match_prefix(A, count_hit=True).last_node)
    host.on_hit(path)
    assert settle(host) == [] and nodes[0].host_pages is None, "host tier: backed up at the first hit"
    device.tree.match_prefix(A, count_hit=True)
    host.on_hit(path)
    assert settle(host) == nodes
    assert_host_kv(host.host, nodes[0].host_pages, A, "host")


def test_write_back_copies_at_eviction():
    device, host = tiers(device_pages=4, policy=WritePolicy.WRITE_BACK)
    nodes = compute(device, A)
    host.on_new_nodes(nodes)
    assert nodes[0].host_pages is None, "host tier: write-back copied before eviction"
    device.alloc(4, keep_if=host.write_back)
    assert nodes[0].device_pages is None and nodes[0].host_pages is not None, "host tier: evicted without a copy"
    assert_host_kv(host.host, nodes[0].host_pages, A, "host")
    assert host.stats.backup_pages == 3


def test_no_host_memory_skips_the_backup():
    device, host = tiers(host_pages=2)
    nodes = compute(device, A)
    host.on_new_nodes(nodes)
    assert nodes[0].host_pages is None and host.stats.backup_skipped_host_full_pages == 3


def test_host_eviction_makes_room_for_a_backup():
    device, host = tiers(device_pages=8, host_pages=3, policy=WritePolicy.WRITE_BACK)
    compute(device, A)
    device.alloc(8, keep_if=host.write_back)  # A now host-only, filling the host pool
    device.allocator.free(list(range(8)))
    b = [t + 50 for t in A]
    compute(device, b)
    device.alloc(8, keep_if=host.write_back)
    assert device.tree.match_prefix(A).host_tokens == 0, "host tier: the older host-only prefix was kept"
    assert device.tree.match_prefix(b).host_tokens == len(b)


def test_a_failed_backup_is_a_miss(monkeypatch):
    device, host = tiers()

    def broken(*_):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(host.host, "backup", broken)
    nodes = compute(device, A)
    host.on_new_nodes(nodes)
    assert settle(host) == []
    assert nodes[0].host_pages is None and nodes[0].lock_ref == 0
    assert host.host.allocator.free_pages == host.host.allocator.num_pages, "host tier: a failed backup kept its pages"
    assert host.backup_worker.failures == 1 and host.stats.backup_pages == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_back_restores_the_bytes(layout):
    device, host = tiers(device_pages=6, policy=WritePolicy.WRITE_BACK, layout=layout)
    compute(device, A)
    evict_to_host(device, host)
    match = device.tree.match_prefix(A)
    assert match.host_tokens == len(A)
    pages = host.load_back(match, budget=3, alloc=device.alloc).device_pages
    assert len(pages) == 3 and all(n.on_device for n in match.host_nodes)
    wait = host.before_layer()
    assert wait is not None, "host tier: a load in flight has no layer events"
    for layer in range(LAYERS):
        wait(layer)
    assert_kv(device.pool, pages, A, "host")
    settle(host)
    assert host.before_layer() is None
    assert host.stats.load_pages == 3


def test_load_back_is_all_or_nothing():
    device, host = tiers(device_pages=6, policy=WritePolicy.WRITE_BACK, threshold=4 * PAGE)
    compute(device, A)
    evict_to_host(device, host)
    match = device.tree.match_prefix(A)
    assert host.load_back(match, budget=3, alloc=device.alloc) is None, "loaded a hit under the threshold"
    host.load_back_threshold = 0
    assert host.load_back(match, budget=2, alloc=device.alloc) is None, "loaded more than the budget"
    assert not any(n.on_device for n in match.host_nodes)
    assert host.stats.load_pages == 0


def test_layer_events_let_a_layer_go_before_the_next_has_loaded(monkeypatch):
    device, host = tiers(device_pages=6, policy=WritePolicy.WRITE_BACK)
    compute(device, A)
    evict_to_host(device, host)
    gate = threading.Event()
    real = HostKVPool.load_layer

    def slow(self, pool, layer, host_pages, device_pages):
        if layer == LAYERS - 1:
            assert gate.wait(10)
        real(self, pool, layer, host_pages, device_pages)

    monkeypatch.setattr(HostKVPool, "load_layer", slow)
    pages = host.load_back(device.tree.match_prefix(A), budget=3, alloc=device.alloc).device_pages
    wait = host.before_layer()
    wait(0)  # returns while the last layer is still held back
    assert host.loads.ready() == 0, "host tier: the load finished before its last layer was copied"
    gate.set()
    wait(LAYERS - 1)
    assert_kv(device.pool, pages, A, "host")
    settle(host)


def test_drain_applies_every_backup_and_leaves_nothing_locked():
    device, host = tiers()
    host.on_new_nodes(compute(device, A))
    assert [len(group) for group in host.drain()] == [1]
    assert device.tree.locked_nodes() == [] and len(host.backups) == 0
    device.evict_all()
    host.evict_all()
    device.tree.reset()
    assert host.leak_report() == [] and host.usage()[0] == 0
    host.shutdown()


def test_a_full_host_tier_drops_lru_copies_of_device_resident_prefixes_before_refusing():
    """Host memory holding only copies of what the device has must still make room (else a ratio-1 host
    tier starves prefetch for good); the least recently used unlocked copy goes first, locked ones stay."""
    device, host = tiers(device_pages=8, host_pages=6, policy=WritePolicy.WRITE_THROUGH)
    a, b = list(range(3 * PAGE)), list(range(100, 100 + 3 * PAGE))
    old, new = compute(device, a), compute(device, b)  # `old` is the less recently used
    host.on_new_nodes(old + new)
    settle(host)
    assert host.host.allocator.free_pages == 0 and old[0].on_device and new[0].on_device
    device.tree.lock(new[0])
    pages = host.alloc(2)
    assert pages is not None and len(pages) == 2, "host tier: refused although copies could be dropped"
    assert old[0].host_pages is None and old[0].on_device, "host tier: dropped the wrong copy, or the device KV"
    assert new[0].host_pages is not None, "host tier: dropped a locked node's copy"
    assert host.stats.host_copies_dropped_pages == 3
    assert host.alloc(4) is None, "host tier: dropped a locked copy to satisfy a request"
    device.tree.unlock(new[0])


def test_a_host_tier_no_larger_than_the_device_pool_is_warned_about(caplog):
    with caplog.at_level("WARNING"):
        assert host_pool_pages(device_pool(16), HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=1.0)) == 16
    assert "no larger than the device pool" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        host_pool_pages(device_pool(16), HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=2.0))
    assert caplog.text == ""
