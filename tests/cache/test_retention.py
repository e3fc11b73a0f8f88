"""Retention hints in eviction (hicache/cache/retention.py; docs/DESIGN.md, "retention hints"): on random
operations over both tiers with random hints and arrivals, every device and host eviction takes exactly
the nodes, in exactly the order, that a heap rebuilt from the whole tree by (effective priority, last
use) would take (without hints that is the plain LRU order, test_radix_lru.py); a retained prefix
outlives plain LRU, and falls back to it once its retention lapses."""

import math
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache import radix_lru, retention
from hicache.cache.radix import RadixTree, TreeNode
from hicache.cache.retention import NO_RETENTION, Retention
from tests.cache.kv import PAGE, settle, tiers, write_kv
from tests.cache.test_radix_lru import CheckedTiers, run_then_drain
from tests.cache.test_radix_tiers import OPERATIONS

arrivals = st.tuples(
    st.just("arrive"),
    st.tuples(st.sampled_from([0, 0, 1, 2]), st.sampled_from([None, 0.0, 0.5, 2.0]), st.sampled_from([0.0, 0.4, 1.0])),
)
ops = st.lists(st.one_of(*OPERATIONS, arrivals, st.tuples(st.just("detach"), st.integers(0, 50))), max_size=60)


class HintedTiers(CheckedTiers):
    """CheckedTiers whose matches and inserts carry the hint of the latest arrival, checked against a
    full rebuild in (effective priority, last use) order."""

    def __init__(self) -> None:
        super().__init__()
        self.hint = NO_RETENTION
        self.clock = 0.0
        for name in ("match_prefix", "insert"):
            setattr(self.tree, name, self._hinted(getattr(self.tree, name)))

    def _hinted(self, call):
        return lambda *args, **kwargs: call(*args, retention=self.hint, **kwargs)

    def order_key(self, node: TreeNode) -> tuple:
        return self.tree.retention.effective(node), node.last_access, node.id

    def arrive(self, hint) -> None:
        priority, seconds, after = hint
        self.clock += after
        self.hint = Retention(priority, seconds, since=self.clock)


@pytest.mark.parametrize("min_compact", [radix_lru._MIN_COMPACT, 1], ids=["threshold", "always"])
@settings(max_examples=200, deadline=None)
@given(operations=ops)
def test_eviction_order_with_hints_equals_a_full_rebuild(min_compact, operations):
    with (
        mock.patch.object(radix_lru, "_MIN_COMPACT", min_compact),
        mock.patch.object(retention, "_MIN_COMPACT", min_compact),
    ):
        run_then_drain(HintedTiers(), operations)


def three_prompts(hint: Retention) -> tuple[RadixTree, list[list[int]]]:
    """A tree holding prompts a (inserted with `hint`), b and c, in that order of use."""
    tree = RadixTree(PAGE, on_device_free=lambda pages: None)
    prompts = [[i] * PAGE for i in range(3)]
    tree.insert(prompts[0], [0], retention=hint)
    for i in (1, 2):
        tree.insert(prompts[i], [i], retention=Retention(since=hint.since))
    return tree, prompts


def evicted_first(tree: RadixTree, prompts: list[list[int]], now: float) -> int:
    """Which prompt an eviction of one page takes, after a request arriving at `now` matched nothing."""
    tree.match_prefix([9] * PAGE, retention=Retention(since=now))
    tree.evict(1)
    return next(i for i, p in enumerate(prompts) if tree.match_prefix(p).num_tokens == 0)


def test_a_retained_prompt_outlives_lru_until_its_retention_lapses():
    tree, prompts = three_prompts(NO_RETENTION)
    assert evicted_first(tree, prompts, now=1.0) == 0, "plain LRU takes the oldest"
    assert tree.retention_stats().deferred_device_evictions == 0
    tree, prompts = three_prompts(Retention(priority=1, seconds=10.0, since=0.0))
    assert evicted_first(tree, prompts, now=9.0) == 1, "retained: the next least recent goes instead"
    assert tree.retention_stats().deferred_device_evictions == 1
    assert tree.retention_stats().held_device_pages == 1
    tree, prompts = three_prompts(Retention(priority=1, seconds=10.0, since=0.0))
    assert evicted_first(tree, prompts, now=10.0) == 0, "lapsed: LRU again"
    stats = tree.retention_stats()
    assert stats.lapsed_nodes == 1 and stats.deferred_device_evictions == 0 and stats.held_device_pages == 0
    tree, prompts = three_prompts(Retention(priority=1, since=0.0))
    assert evicted_first(tree, prompts, now=1e9) == 1, "no retention_seconds: the priority never lapses"


def test_a_node_keeps_the_highest_hint_and_the_later_end_of_equal_ones():
    tree = RadixTree(PAGE, on_device_free=lambda pages: None)
    node = tree.insert([1] * PAGE, [0], retention=Retention(priority=2, seconds=5.0, since=0.0)).last_node
    tree.match_prefix([1] * PAGE, retention=Retention(priority=1, seconds=100.0, since=1.0))
    assert (node.priority, node.retain_until) == (2, 5.0), "a lower hint changes nothing while a higher holds"
    tree.match_prefix([1] * PAGE, retention=Retention(priority=2, seconds=5.0, since=3.0))
    assert node.retain_until == 8.0, "the same priority again: retained from this use on"
    tree.match_prefix([1] * PAGE, retention=Retention(priority=1, seconds=1.0, since=9.0))
    assert (node.priority, node.retain_until) == (1, 10.0), "after the higher one lapsed, the lower one holds"


def test_a_split_node_keeps_its_retention_and_lapses_as_the_whole():
    tree = RadixTree(PAGE, on_device_free=lambda pages: None)
    tree.insert([1] * 2 * PAGE, [0, 1], retention=Retention(priority=3, seconds=2.0, since=0.0))
    upper = tree.match_prefix([1] * PAGE).last_node  # splits the node after its first page
    assert (upper.priority, upper.retain_until) == (3, 2.0)
    tree.match_prefix([7] * PAGE, retention=Retention(since=5.0))
    tree.evict(0)  # lapses what ran out, takes nothing
    assert upper.priority == 0 and tree.retention.stats.lapsed_nodes == 2


def test_host_copies_of_retained_prefixes_are_dropped_last():
    """A full host tier frees copies of device-resident prefixes LRU first, retained ones after the rest."""
    device, host = tiers(device_pages=8, host_pages=3)
    hint = Retention(priority=1, seconds=10.0)
    nodes = []
    for i in range(3):  # the retained prompt is the least recently used
        pages = device.alloc(1)
        write_kv(device.pool, pages, [i] * PAGE)
        nodes += device.insert([i] * PAGE, pages, "", retention=hint if i == 0 else NO_RETENTION).new_nodes
    host.on_new_nodes(nodes)
    settle(host)
    assert host.alloc(2) is not None
    assert [n.host_pages is not None for n in nodes] == [True, False, False], "the retained copy stays"
    assert host.stats.host_copies_dropped_pages == 2
    assert device.tree.retention.stats.evicted_retained_host_pages == 0
    host.shutdown()


@pytest.mark.parametrize("bad", [dict(priority=-1), dict(seconds=-1.0), dict(seconds=math.inf), dict(seconds=math.nan)])
def test_a_hint_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="priority|retention_seconds"):
        Retention(**bad)
