"""A look at the cache changes nothing (docs/DESIGN.md, "cache API"): `KVCache.open`, and the tree's
`peek` under it, leave every node, the clock and both eviction heaps exactly as they
were, also where the prompt's match ends inside a node (which a match splits) and with a storage tier
(whose prefetch starts at arrival); and what a peek reports is what a match then finds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.radix import RadixTree, TreeNode
from hicache.cache.radix_lru import LRUCandidates
from tests.cache.kv import PAGE
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
        tuple((key, _node(child)) for key, child in node.children.items()),
    )


def _heap(lru: LRUCandidates) -> tuple:
    """The eviction candidates' entries in heap order (their nodes by id), and the compaction mark."""
    return tuple((last_access, node_id) for last_access, node_id, _ in lru._heap), lru._compact_at


def dump(tree: RadixTree) -> tuple:
    """Everything of the tree that a read must leave as it was: every root and node, the clock's next
    tick, the page counts, and both eviction heaps."""
    return (
        tuple((namespace, _node(root)) for namespace, root in tree._roots.items()),
        repr(tree._clock),  # count(n): the next tick, read without taking it
        (tree.evictable_pages, tree.protected_pages, tuple(tree.evictable_by_class), tuple(tree.protected_by_class)),
        _heap(tree._device_lru),
        _heap(tree._host_lru),
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
        prefetch = cache.storage.prefetches[rid]
        assert prefetch.start_page == matched, f"{name}: the prefetch does not start after the tree's match"
        assert len(prefetch.hashes) == (len(prompt) - 1) // PAGE - matched
        cache.release(handle, [])
    cache.flush()
    assert cache.leak_report() == []
    cache.shutdown()
