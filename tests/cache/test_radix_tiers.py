"""Property tests of the tree's two residencies against a content oracle: every device or host page
holds the KV of exactly the token prefix it is served for, device residency stays a prefix of every
path, locked paths survive both evictions, and every page returns to its pool."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.radix import RadixTree
from hicache.mem.allocator import PageAllocator

PAGE = 4
DEVICE_PAGES = 24
HOST_PAGES = 32

seqs = st.lists(st.integers(0, 2), min_size=0, max_size=6 * PAGE)
OPERATIONS = (  # what `Tiers.apply` runs
    st.tuples(st.just("insert"), seqs),
    st.tuples(st.just("insert_host"), seqs),
    st.tuples(st.just("backup"), st.integers(0, 50)),
    st.tuples(st.just("match"), seqs),
    st.tuples(st.just("lock"), seqs),
    st.tuples(st.just("unlock"), st.integers(0, 10)),
    st.tuples(st.just("evict"), st.integers(1, 10)),
    st.tuples(st.just("evict_host"), st.integers(1, 10)),
    st.tuples(st.just("load"), seqs),
)
ops = st.lists(st.one_of(*OPERATIONS), max_size=40)


class Tiers:
    def __init__(self) -> None:
        self.dev = PageAllocator(DEVICE_PAGES, PAGE)
        self.host = PageAllocator(HOST_PAGES, PAGE)
        self.tree = RadixTree(PAGE, on_device_free=self._free_dev, on_host_free=self._free_host)
        self.dev_content: dict[int, tuple] = {}
        self.host_content: dict[int, tuple] = {}
        self.locks: list = []

    def _free_dev(self, pages):
        for p in pages:
            del self.dev_content[p]
        self.dev.free(pages)

    def _free_host(self, pages):
        for p in pages:
            del self.host_content[p]
        self.host.free(pages)

    def _alloc(self, alloc, n, evict):
        pages = alloc.alloc(n)
        if pages is None:
            evict(n - alloc.free_pages)
            pages = alloc.alloc(n)
        return pages

    def insert(self, tokens):
        n = len(tokens) - len(tokens) % PAGE
        tokens = tokens[:n]
        pages = self._alloc(self.dev, n // PAGE, self.tree.evict)
        if pages is None:
            return
        for i, p in enumerate(pages):
            self.dev_content[p] = tuple(tokens[: (i + 1) * PAGE])
        res = self.tree.insert(tokens, pages)
        dup = [p for p, t in zip(pages, res.pages) if p != t]
        for p in dup:
            del self.dev_content[p]
        self.dev.free(dup)

    def insert_host(self, tokens):
        """Like a prefetch: the tail beyond the current match arrives on the host."""
        n = len(tokens) - len(tokens) % PAGE
        m = self.tree.match_prefix(tokens[:n])
        start = (len(m.device_pages) + len(m.host_pages)) * PAGE
        k = (n - start) // PAGE
        if k == 0:
            return
        pages = self._alloc(self.host, k, self.tree.evict_host)
        if pages is None:
            return
        for i, p in enumerate(pages):
            self.host_content[p] = tuple(tokens[: start + (i + 1) * PAGE])
        for p in self.tree.insert_host(tokens[:n], pages):
            del self.host_content[p]
            self.host.free([p])

    def backup(self, index):
        """Give one device-only node a host copy (what an acknowledged write-through does)."""
        nodes = [n for n in self.tree.nodes() if n.on_device and n.host_pages is None]
        if not nodes:
            return
        node = nodes[index % len(nodes)]
        pages = self._alloc(self.host, len(node.device_pages), self.tree.evict_host)
        if pages is None:
            return
        for d, h in zip(node.device_pages, pages):
            self.host_content[h] = self.dev_content[d]
        node.host_pages = pages

    def load(self, tokens):
        """Load back a host-resident continuation, all or nothing."""
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.last_node)
        if m.host_nodes:
            pages = self._alloc(self.dev, len(m.host_pages), self.tree.evict)
            if pages is not None:
                i = 0
                for node in m.host_nodes:
                    k = len(node.host_pages)
                    for d, h in zip(pages[i : i + k], node.host_pages):
                        self.dev_content[d] = self.host_content[h]
                    self.tree.attach_device(node, pages[i : i + k])
                    i += k
        self.tree.unlock(m.last_node)

    def check_match(self, tokens):
        m = self.tree.match_prefix(tokens)
        for i, p in enumerate(m.device_pages):
            assert self.dev_content[p] == tuple(tokens[: (i + 1) * PAGE])
        base = len(m.device_pages)
        for i, p in enumerate(m.host_pages):
            assert self.host_content[p] == tuple(tokens[: (base + i + 1) * PAGE])
        return m

    def apply(self, op, arg):
        """One operation of the `ops` strategy (methods of this class or of a subclass, like detach)."""
        if op == "match":
            self.check_match(arg)
        elif op == "lock":
            m = self.check_match(arg)
            self.tree.lock(m.last_node)
            self.locks.append((m.last_node, list(arg[: m.num_tokens + m.host_tokens])))
        elif op == "unlock":
            if self.locks:
                self.tree.unlock(self.locks.pop(arg % len(self.locks))[0])
        elif op == "evict":
            self.tree.evict(arg)
        elif op == "evict_host":
            self.tree.evict_host(arg)
        else:
            getattr(self, op)(arg)

    def check_invariants(self):
        for node in self.tree.nodes():
            assert node.on_device or node.host_pages is not None, "a node on neither tier must be gone"
            if node.on_device and not node.parent.is_root:
                assert node.parent.on_device, "device residency must be a prefix of every path"
        assert self.dev.free_pages + self.tree.total_pages == DEVICE_PAGES
        assert self.host.free_pages + self.tree.host_pages_held == HOST_PAGES


@settings(max_examples=250, deadline=None)
@given(ops)
def test_tiers_against_content_oracle(operations):
    t = Tiers()
    for op, arg in operations:
        t.apply(op, arg)
        t.check_invariants()
        for _, tokens in t.locks:
            m = t.check_match(tokens)
            assert m.num_tokens + m.host_tokens == len(tokens), "a locked path lost pages"
    for node, _ in t.locks:
        t.tree.unlock(node)
    t.tree.evict(DEVICE_PAGES)
    t.tree.evict_host(HOST_PAGES)
    assert t.dev.free_pages == DEVICE_PAGES and t.host.free_pages == HOST_PAGES
