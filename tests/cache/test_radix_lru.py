"""Property test of the eviction candidates kept across calls (hicache/cache/radix_lru.py): on random
operations over both tiers, every device and host eviction takes exactly the nodes, in exactly the
order, that a heap rebuilt from the whole tree at the call (what eviction did before) would take; with
the heap compacted at every chance as well as at its real threshold."""

import heapq
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache import radix_lru
from hicache.cache.radix import RadixTree, TreeNode
from tests.cache.test_radix_tiers import DEVICE_PAGES, HOST_PAGES, OPERATIONS, PAGE, Tiers

ops = st.lists(
    st.one_of(*OPERATIONS, st.tuples(st.just("detach"), st.integers(0, 50))),
    max_size=60,
)


def lru_key(node: TreeNode) -> tuple:
    """The order eviction had before retention hints: least recently used first."""
    return node.last_access, node.id


def full_rebuild_order(
    tree: RadixTree, num_pages: int, host: bool, key=lru_key, deferrals: list | None = None
) -> list[int]:
    """The ids of the nodes an eviction of `num_pages` takes, by a heap of the whole tree's candidates
    (device: unlocked device nodes without a device child; host: unlocked host-only leaves) in `key`
    order, a node's parent joining when it becomes one. `deferrals`: gets, for each node taken, whether
    a candidate left behind of a higher first key (a retention priority) was used less recently."""
    nodes = list(tree.nodes())
    gone: set[int] = set()  # left the tier being evicted

    def candidate(n: TreeNode) -> bool:
        if n.is_root or n.lock_ref or n.id in gone:
            return False
        if host:
            return n.host_pages is not None and not n.on_device and all(c.id in gone for c in n.children.values())
        return n.on_device and not any(c.on_device and c.id not in gone for c in n.children.values())

    heap = [(key(n), n) for n in nodes if candidate(n)]
    heapq.heapify(heap)
    order: list[int] = []
    freed = 0
    while freed < num_pages and heap:
        (first, *_), node = heapq.heappop(heap)
        if deferrals is not None:
            deferrals.append(any(k[0] > first and n.last_access < node.last_access for k, n in heap))
        order.append(node.id)
        gone.add(node.id)
        freed += node.num_pages
        if candidate(node.parent):
            heapq.heappush(heap, (key(node.parent), node.parent))
    return order


class CheckedTiers(Tiers):
    """Every eviction, including those an allocation triggers, is checked against the full rebuild."""

    order_key = staticmethod(lru_key)

    def __init__(self) -> None:
        super().__init__()
        self.taken: list[int] | None = None  # first pages freed by the eviction being checked
        self._host_check = False  # which tier's frees `taken` records
        for name, host in (("evict", False), ("evict_host", True)):
            setattr(self.tree, name, self._checked(getattr(self.tree, name), host))

    def _checked(self, evict, host: bool):
        def run(num_pages: int) -> int:
            owner = {
                (n.host_pages if host else n.device_pages)[0]: n.id
                for n in self.tree.nodes()
                if (n.host_pages if host else n.device_pages)
            }
            deferrals: list[bool] = []
            expected = full_rebuild_order(self.tree, num_pages, host, self.order_key, deferrals)
            lru = self.tree._host_lru if host else self.tree._device_lru
            deferred = lru.deferred
            self.taken, self._host_check = [], host
            freed = evict(num_pages)
            taken, self.taken = [owner[p] for p in self.taken], None
            assert taken == expected, "eviction order differs from a full rebuild's"
            assert lru.deferred - deferred == sum(deferrals), "deferred evictions differ from a full rebuild's"
            return freed

        return run

    def _free_dev(self, pages):
        if self.taken is not None and not self._host_check:
            self.taken.append(pages[0])
        super()._free_dev(pages)

    def _free_host(self, pages):
        if self.taken is not None and self._host_check:
            self.taken.append(pages[0])
        super()._free_host(pages)

    def detach(self, index):
        """A failed load: a device node with a host copy gives its device pages back."""
        nodes = [n for n in self.tree.nodes() if n.on_device and n.host_pages is not None]
        if nodes:
            for p in self.tree.detach_device([nodes[index % len(nodes)]]):
                del self.dev_content[p]
                self.dev.free([p])


@pytest.mark.parametrize("min_compact", [radix_lru._MIN_COMPACT, 1], ids=["threshold", "always"])
@settings(max_examples=250, deadline=None)
@given(operations=ops)
def test_eviction_order_equals_a_full_rebuild(min_compact, operations):
    with mock.patch.object(radix_lru, "_MIN_COMPACT", min_compact):
        t = CheckedTiers()
    run_then_drain(t, operations)


def run_then_drain(t: CheckedTiers, operations) -> None:  # noqa: ANN001 - hypothesis's (op, arg) pairs
    """Apply `operations`, checking the invariants after each; then unlock everything and evict every
    candidate there is, in order (each pop checked against a full rebuild): the tree empties completely."""
    for op, arg in operations:
        t.apply(op, arg)
        t.check_invariants()
    for node, _ in t.locks:
        t.tree.unlock(node)
    t.tree.evict(t.tree.total_pages + 1)
    t.tree.evict_host(t.tree.host_pages_held + 1)
    assert not list(t.tree.nodes()), "an unlocked tree empties completely"
    assert t.dev.free_pages == DEVICE_PAGES and t.host.free_pages == HOST_PAGES


# Offers the random operations above rarely isolate: a candidate whose entry is gone (dropped while it
# was not a candidate, or never made) and that becomes one again without being touched.


def two_leaves(freed_host: list[int]) -> tuple[RadixTree, list[int], list[int]]:
    tree = RadixTree(PAGE, on_device_free=lambda pages: None, on_host_free=freed_host.extend)
    a, b = [1] * PAGE, [2] * PAGE
    tree.insert(a, [0])
    tree.insert(b, [1])  # more recent than a
    return tree, a, b


def test_unlock_offers_again_what_a_pop_dropped_while_locked():
    tree, a, _ = two_leaves([])
    node_a = tree.match_prefix(a).last_node
    tree.match_prefix([2] * PAGE)  # b is touched: a is the least recent
    tree.lock(node_a)
    assert tree.evict(1) == 1  # drops a's entry (locked), takes b
    tree.unlock(node_a)
    assert tree.evict(1) == 1, "a, unlocked again, must be a candidate"


def test_unlock_offers_again_a_host_leaf_whose_entry_was_dropped():
    freed: list[int] = []
    tree, a, b = two_leaves(freed)
    for node, host in zip([tree.match_prefix(a).last_node, tree.match_prefix(b).last_node], ([10], [11])):
        node.host_pages = host  # backed up
    tree.evict(2)  # both stay, host-only
    node_a = tree.match_prefix(a).last_node
    tree.match_prefix(b)
    tree.lock(node_a)
    assert tree.evict_host(1) == 1 and freed == [11]
    tree.unlock(node_a)
    assert tree.evict_host(1) == 1 and freed == [11, 10]


def test_detach_offers_the_parent_it_leaves_without_a_device_child():
    tree = RadixTree(PAGE, on_device_free=lambda pages: None, on_host_free=lambda pages: None)
    parent, child = [1] * PAGE, [1] * PAGE + [2] * PAGE
    tree.insert(parent, [0])
    last = tree.insert(child, [0, 1]).last_node  # touches the parent: its entry is stale
    last.host_pages = [10]
    assert tree.detach_device([last]) == [1]
    assert tree.evict(1) == 1, "the parent is a device leaf now"


def test_attach_offers_a_node_it_puts_back_on_the_device():
    tree = RadixTree(PAGE, on_device_free=lambda pages: None, on_host_free=lambda pages: None)
    last = tree.insert([1] * PAGE + [2] * PAGE, [0, 1]).last_node
    last.host_pages = [10]
    tree.match_prefix([1] * PAGE)  # the child is the least recent
    assert tree.evict(1) == 1 and not last.on_device  # host-only now; its device entry is gone
    tree.attach_device(last, [5])
    assert tree.evict(1) == 1 and not last.on_device, "the re-attached node is the device leaf"
