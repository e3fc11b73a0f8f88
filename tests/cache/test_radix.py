"""Property tests of the radix tree against a naive reference: every cached page's content is the
token prefix it was computed for, so a match that returns a page for the wrong prefix is caught."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.radix import RadixTree
from hicache.mem.allocator import PageAllocator

PAGE = 4
POOL_PAGES = 48

# Small alphabets and short sequences make shared prefixes (and so splits) common.
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=7 * PAGE)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), seqs, st.sampled_from(["", "salt"])),
        st.tuples(st.just("match"), seqs, st.sampled_from(["", "salt"])),
        st.tuples(st.just("lock"), seqs, st.sampled_from(["", "salt"])),
        st.tuples(st.just("unlock"), st.integers(0, 10), st.just("")),
        st.tuples(st.just("evict"), st.integers(1, 12), st.just("")),
    ),
    max_size=40,
)


class Harness:
    def __init__(self) -> None:
        self.alloc = PageAllocator(POOL_PAGES, PAGE)
        self.tree = RadixTree(PAGE, on_device_free=self._evicted)
        self.content: dict[int, tuple] = {}  # page -> (namespace, token prefix ending with that page)
        self.reference: set[tuple] = set()  # (namespace, page-aligned prefix) ever inserted
        self.locks: list = []  # (node, namespace, tokens) held

    def _evicted(self, pages: list[int]) -> None:
        for p in pages:
            del self.content[p]
        self.alloc.free(pages)

    def insert(self, tokens: list[int], ns: str) -> None:
        n = len(tokens) - len(tokens) % PAGE
        tokens = tokens[:n]
        pages = self.alloc.alloc(n // PAGE)
        if pages is None:
            self.tree.evict(n // PAGE - self.alloc.free_pages)
            pages = self.alloc.alloc(n // PAGE)
            if pages is None:
                return
        for i, p in enumerate(pages):
            self.content[p] = (ns, tuple(tokens[: (i + 1) * PAGE]))
        res = self.tree.insert(tokens, pages, ns)
        dup = [p for p, t in zip(pages, res.pages) if p != t]
        for p in dup:
            del self.content[p]
        self.alloc.free(dup)
        for i in range(0, n, PAGE):
            self.reference.add((ns, tuple(tokens[: i + PAGE])))

    def check_match(self, tokens: list[int], ns: str):
        m = self.tree.match_prefix(tokens, ns)
        assert m.num_tokens % PAGE == 0 and m.num_tokens <= len(tokens)
        for i, p in enumerate(m.device_pages):
            assert self.content[p] == (ns, tuple(tokens[: (i + 1) * PAGE])), "page served for the wrong prefix"
        return m

    def check_accounting(self) -> None:
        assert self.alloc.free_pages + self.tree.total_pages == POOL_PAGES, "pages leaked or double-counted"
        assert len(self.content) == self.tree.total_pages
        assert sum(len(n.device_pages) for n in self.tree.nodes()) == self.tree.total_pages
        locked = sum(len(n.device_pages) for n in self.tree.nodes() if n.lock_ref > 0)
        assert locked == self.tree.protected_pages


@settings(max_examples=300, deadline=None)
@given(ops)
def test_tree_matches_reference(operations):
    h = Harness()
    evicted_any = False
    for op, arg, ns in operations:
        if op == "insert":
            h.insert(arg, ns)
        elif op == "match":
            m = h.check_match(arg, ns)
            if not evicted_any:
                # Without eviction the tree holds exactly what was inserted: the longest page-aligned
                # prefix ever inserted is what must match.
                best = max(
                    (i for i in range(0, len(arg) + 1, PAGE) if i == 0 or (ns, tuple(arg[:i])) in h.reference),
                    default=0,
                )
                expected = 0
                while expected + PAGE <= best and (ns, tuple(arg[: expected + PAGE])) in h.reference:
                    expected += PAGE
                assert m.num_tokens == expected
        elif op == "lock":
            m = h.check_match(arg, ns)
            h.tree.lock(m.last_node)
            h.locks.append((m.last_node, ns, list(arg[: m.num_tokens])))
        elif op == "unlock" and h.locks:
            node, _, _ = h.locks.pop(arg % len(h.locks))
            h.tree.unlock(node)
        elif op == "evict":
            h.tree.evict(arg)
            evicted_any = True
        h.check_accounting()
        for _, lns, ltokens in h.locks:
            # A locked path is never evicted: its whole prefix still matches.
            assert h.check_match(ltokens, lns).num_tokens == len(ltokens)
    for node, _, _ in h.locks:
        h.tree.unlock(node)
    h.tree.evict(POOL_PAGES)
    assert h.alloc.free_pages == POOL_PAGES, "evicted tokens must all return to the pool"
    assert not h.tree.locked_nodes()


def test_salts_never_share_pages():
    h = Harness()
    h.insert([1] * 8, "a")
    assert h.check_match([1] * 8, "a").num_tokens == 8
    assert h.check_match([1] * 8, "b").num_tokens == 0


def test_split_keeps_lock_and_pages():
    h = Harness()
    h.insert([1, 1, 1, 1, 2, 2, 2, 2], "")
    m = h.check_match([1, 1, 1, 1, 3, 3, 3, 3], "")
    assert m.num_tokens == 4
    h.tree.lock(m.last_node)
    h.tree.evict(POOL_PAGES)
    assert h.check_match([1, 1, 1, 1], "").num_tokens == 4
    assert h.check_match([1, 1, 1, 1, 2, 2, 2, 2], "").num_tokens == 4  # the unlocked tail went
    h.tree.unlock(m.last_node)
    h.check_accounting()


def test_lru_evicts_least_recent_leaf_first():
    h = Harness()
    h.insert([0] * 4, "")
    h.insert([1] * 4, "")
    h.check_match([0] * 4, "")  # touch: [1]*4 is now the least recent
    h.tree.evict(1)
    assert h.check_match([0] * 4, "").num_tokens == 4
    assert h.check_match([1] * 4, "").num_tokens == 0
