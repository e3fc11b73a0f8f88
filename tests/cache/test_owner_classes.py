"""Sharded pages through the cache (hicache/cache/page_budget.py, device_tier.py, radix.py, prefix_cache.py), as
properties over random request streams: owners cycle along every prefix; each prefix's pages spread
over the owner classes within one page; the rotation check refuses exactly the conflicting inserts;
allocation by class always terminates, and succeeds whenever admission said it would fit."""

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.build import device_cache
from hicache.cache.device_tier import DeviceTier
from hicache.cache.radix import RadixTree
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout

PAGE = 2


def sharded_pool(shards: int, local_pages: int) -> DeviceKVPool:
    return DeviceKVPool(KVLayout.mha(1, 1), 1, local_pages, PAGE, torch.float32, torch.device("cpu"), shards, 0)


def assert_cycles(pages: list[int], rotation: int, shards: int, what: str) -> None:
    classes = [q % shards for q in pages]
    assert classes == [(rotation + i) % shards for i in range(len(pages))], f"{what}: owners {classes}"
    counts = Counter(classes)
    spread = [counts.get(c, 0) for c in range(shards)]
    assert max(spread) - min(spread) <= 1, f"{what}: per-class counts {spread}"


def tree_paths(tree: RadixTree):
    """(device pages along the path from the root, its rotation) for every device node."""
    for node in tree.nodes():
        path = tree.path_to_root(node)
        if all(n.on_device for n in path):
            yield [q for n in path for q in n.device_pages], node.rotation


# A request: which of four base prompts it extends, how many pages of it, and a distinct tail.
requests = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(0, 2), st.booleans()), max_size=25)


@settings(max_examples=120, deadline=None)
@given(st.integers(2, 4), st.integers(3, 10), requests)
def test_owners_cycle_along_every_prefix_after_any_allocs_and_frees(shards, local_pages, stream):
    pool = sharded_pool(shards, local_pages)
    cache = device_cache(pool)
    live = []
    for rid, (base, length, tail, finish_early) in enumerate(stream):
        tokens = [base * 100 + i for i in range(length * PAGE)] + [1000 + rid] * tail
        handle = cache.open(rid, tokens, "")
        if not cache.admit(handle, -(-len(tokens) // PAGE)).admitted:
            cache.release(handle, tokens)
            continue
        cache.extend(handle, len(tokens))
        handle.advance(len(tokens))
        assert_cycles(handle.pages, handle.rotation, shards, f"request {rid}")
        live.append((handle, tokens))
        if finish_early and live:
            done, done_tokens = live.pop(0)
            cache.release(done, done_tokens)
        for pages, rotation in tree_paths(cache.tree):
            assert_cycles(pages, rotation, shards, "a cached path")
        held = sum(len(h.pages) for h, _ in live) + cache.tree.total_pages
        shared = sum(h.committed_len // PAGE for h, _ in live)  # tree pages a live handle also lists
        assert pool.allocator.used_pages == held - shared, "pages leaked or handed out twice"
    for handle, tokens in live:
        cache.release(handle, tokens)
    cache.flush()
    assert cache.leak_report() == [] and cache.reserved_by_class == [0] * shards


inserts = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.integers(0, 3)), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 4), inserts)
def test_the_rotation_check_refuses_exactly_the_conflicting_inserts(shards, stream):
    tree = RadixTree(PAGE, on_device_free=lambda pages: None, num_classes=shards)
    subtree_rotation: dict[int, int] = {}  # oracle: first token of a cached root subtree -> its base
    next_page = iter(range(10_000))
    for family, length, rotation in stream:
        rotation %= shards
        tokens = [family * 100 + i for i in range(length * PAGE)]
        pages = [next(next_page) for _ in range(length)]
        res = tree.insert(tokens, pages, rotation=rotation)
        cached = subtree_rotation.get(tokens[0])
        assert res.refused == (cached is not None and cached != rotation), (tokens[0], cached, rotation)
        if not res.refused:
            subtree_rotation.setdefault(tokens[0], rotation)
            assert all(n.rotation == rotation for n in tree.path_to_root(res.last_node))


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 3), st.integers(4, 9), requests, st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_eviction_until_every_class_has_room_terminates(shards, local_pages, stream, wanted):
    pool = sharded_pool(shards, local_pages)
    cache = device_cache(pool)
    for rid, (base, length, tail, _) in enumerate(stream):  # fill the cache with unlocked prefixes
        tokens = [base * 100 + i for i in range(length * PAGE)] + [1000 + rid] * tail
        handle = cache.open(rid, tokens, "")
        if cache.admit(handle, -(-len(tokens) // PAGE)).admitted:
            cache.extend(handle, len(tokens))
            handle.advance(len(tokens))
        cache.release(handle, tokens)
    device: DeviceTier = cache.device
    classes = [c % shards for c in wanted]
    fits = device.budget.pool_room(classes)  # nothing is promised: every handle was released
    nodes_before = len(list(device.tree.nodes()))
    calls = []
    evict = device.tree.evict

    def counted(n, keep_if=None):
        calls.append(n)
        return evict(n, keep_if)

    device.tree.evict = counted  # type: ignore[method-assign]
    try:
        pages = device.alloc(len(classes), classes=classes)
    except RuntimeError:  # the reservation invariant: only where admission would have refused
        assert not fits
        return
    # Each round evicts at least one node, or finds nothing to evict and stops.
    assert len(calls) <= nodes_before + 1
    assert [q % shards for q in pages] == classes
