"""A look at the cache changes nothing (docs/DESIGN.md, "cache API"): `KVCache.open` and `KVCache.lookup`,
and the tree's `peek` under them, leave every node, the clock and both eviction heaps exactly as they
were, also where the prompt's match ends inside a node (which a match splits) and with a storage tier
(whose prefetch starts at arrival); and what they report is what a match, or admission, then finds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.api import PrefixMatch
from hicache.cache.build import device_cache
from hicache.cache.radix import RadixTree, TreeNode
from hicache.cache.radix_lru import LRUCandidates
from tests.cache.kv import PAGE, device_pool
from tests.cache.test_api import pages_for, run_prompt
from tests.cache.test_hierarchical import A, B, cache_for, serve, settle
from tests.cache.test_radix_tiers import DEVICE_PAGES, OPERATIONS, Tiers, seqs


def _node(node: TreeNode) -> tuple:
    """A node and its subtree, every field a read could touch, children in their dict's order."""
    return (
        node.id,
        bytes(node.key),
        None if node.device_pages is None else tuple(node.device_pages),
        None if node.host_pages is None else tuple(node.host_pages),
        None if node.hashes is None else tuple(node.hashes),
        node.last_access,
        node.hit_count,
        node.lock_ref,
        node.backup_pending,
        node.rotation,
        (node.priority, node.retain_until),
        tuple((key, _node(child)) for key, child in node.children.items()),
    )


def _heap(lru: LRUCandidates) -> tuple:
    """The eviction candidates' entries in heap order (their nodes by id), the retained ones', and the
    compaction mark."""
    entries = tuple((priority, last_access, node_id) for priority, last_access, node_id, _ in lru._heap)
    return entries, tuple((last_access, node_id) for last_access, node_id, _ in lru._retained), lru._compact_at


def dump(tree: RadixTree) -> tuple:
    """Everything of the tree that a read must leave as it was: every root and node, the clock's next
    tick, the page counts, both eviction heaps, and the retention timeline (its clock and heap)."""
    return (
        tuple((namespace, _node(root)) for namespace, root in tree._roots.items()),
        repr(tree._clock),  # count(n): the next tick, read without taking it
        (tree.evictable_pages, tree.protected_pages, tuple(tree.evictable_by_class), tuple(tree.protected_by_class)),
        _heap(tree._device_lru),
        _heap(tree._host_lru),
        tree.retention.now,
        tuple((until, node_id) for until, node_id, _ in tree.retention._heap),
    )


def query(data, tree: RadixTree) -> list[int]:
    """A query that often ends inside a cached node: the tokens of a node's path cut anywhere in the
    node's run, then a random tail (or, with nothing cached, the tail alone)."""
    nodes = sorted(tree.nodes(), key=lambda n: n.id)
    cut: list[int] = []
    if nodes:
        node = data.draw(st.sampled_from(nodes))
        path = [token for n in tree.path_to_root(node) for token in n.tokens]
        cut = path[: data.draw(st.integers(len(path) - node.num_tokens, len(path)))]
    return cut + data.draw(seqs)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(seqs, min_size=1, max_size=8),
    pushed=st.integers(0, DEVICE_PAGES // 2),
    operations=st.lists(st.one_of(*OPERATIONS), max_size=20),
    data=st.data(),
)
def test_a_peek_changes_nothing_and_reports_what_a_match_finds(prompts, pushed, operations, data):
    t = Tiers()
    for prompt in prompts:
        t.insert(prompt)
    for _ in list(t.tree.nodes()):  # everything backed up, then `pushed` pages evicted: host-only paths
        t.backup(0)
    t.tree.evict(pushed)
    for op, arg in operations:  # host-only continuations, backups, locks, evictions, loads
        t.apply(op, arg)
    for _ in range(data.draw(st.integers(1, 6))):
        tokens = query(data, t.tree)
        before = dump(t.tree)
        peek = t.tree.peek(tokens)
        assert dump(t.tree) == before, "peek changed the tree"
        match = t.tree.match_prefix(tokens)  # splits where the match ends inside a node: the next query sees that
        found = (peek.device_tokens, peek.host_tokens, peek.rotation)
        assert found == (match.num_tokens, match.host_tokens, match.rotation), "peek and match disagree"


served = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5 * PAGE), min_size=1, max_size=8)


@settings(max_examples=80, deadline=None)
@given(prompts=served, data=st.data())
def test_lookup_changes_nothing_and_is_what_admission_reuses(prompts, data):
    cache = device_cache(device_pool(24))
    for rid, prompt in enumerate(prompts):
        _, handle, tokens = run_prompt(cache, rid, prompt)
        cache.release(handle, tokens)
    for rid in range(len(prompts), len(prompts) + data.draw(st.integers(1, 6))):
        prompt = query(data, cache.tree)
        before = dump(cache.tree)
        found = cache.lookup(prompt, "")
        handle = cache.open(rid, prompt, "")
        assert dump(cache.tree) == before, "lookup or open changed the tree"
        admission = cache.admit(handle, pages_for(len(prompt) + 1))
        assert admission.admitted and admission.cached == found, "lookup is not what admission reused"
        cache.release(handle, prompt)
    cache.flush()
    assert cache.leak_report() == []


def mid_node_prompts() -> dict[str, list[int]]:
    """After serving A then B on six device pages: A is one host-only node of four pages, B one device
    node of four; these prompts' matches end inside them."""
    return {"mid-device": B[: 3 * PAGE] + [98] * PAGE + [7], "mid-host": A[: 2 * PAGE] + [99] * (3 * PAGE) + [7]}


def test_open_with_a_storage_tier_changes_nothing_and_still_prefetches(tmp_path):
    cache = cache_for(tmp_path, storage=True)
    serve(cache, 1, A)
    serve(cache, 2, B)
    settle(cache)
    for rid, (name, prompt) in enumerate(mid_node_prompts().items(), start=3):
        before = dump(cache.tree)
        handle = cache.open(rid, prompt, "")
        assert dump(cache.tree) == before, f"{name}: open changed the tree"
        matched = 2 if name == "mid-host" else 3
        prefetch = cache.lower.storage.prefetches[rid]
        assert prefetch.start_page == matched, f"{name}: the prefetch does not start after the tree's match"
        assert len(prefetch.hashes) == (len(prompt) - 1) // PAGE - matched
        cache.release(handle, [])
    cache.flush()
    assert cache.leak_report() == []
    cache.shutdown()


def test_without_storage_open_and_lookup_change_nothing_and_tell_what_admission_reuses(tmp_path):
    cache = cache_for(tmp_path)
    serve(cache, 1, A)
    serve(cache, 2, B)
    settle(cache)
    expected = {
        "mid-host": PrefixMatch(host=2 * PAGE),
        "mid-device": PrefixMatch(device=3 * PAGE),
    }
    for rid, (name, prompt) in enumerate(mid_node_prompts().items(), start=3):
        before = dump(cache.tree)
        found = cache.lookup(prompt, "")
        cache.release(cache.open(rid, prompt, ""), [])
        assert dump(cache.tree) == before, f"{name}: lookup or open changed the tree"
        assert found == expected[name], f"{name}: lookup found {found}"
        assert serve(cache, rid, prompt).cached == found, f"{name}: admission reused other than lookup said"
    cache.flush()
    assert cache.leak_report() == []
    cache.shutdown()


def test_lookup_leaves_the_last_prompt_token_and_unknown_namespaces_alone():
    cache = device_cache(device_pool(16))
    prompt = list(range(10, 10 + 3 * PAGE))
    _, handle, tokens = run_prompt(cache, 1, prompt + [5])
    cache.release(handle, tokens)
    assert cache.lookup(prompt + [5], "") == PrefixMatch(device=3 * PAGE)
    assert cache.lookup(prompt, "") == PrefixMatch(device=2 * PAGE), "the last prompt token is always computed"
    assert cache.lookup([], "") == PrefixMatch()
    before = dump(cache.tree)
    assert cache.lookup(prompt + [5], "salt") == PrefixMatch()
    assert dump(cache.tree) == before, "a lookup in a namespace never seen made its root"
