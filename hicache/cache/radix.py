"""Radix prefix tree over page-aligned token runs, mapping cached prefixes to logical KV pages on the
device tier and, with the hierarchical cache, on the host tier.

Contracts:
- Keys are cut at page boundaries: every node's key length is a multiple of the page size, so a match
  is always a whole number of pages and a node's pages are exactly its tokens' KV.
- A node holds its KV on the device (`device_pages`), on the host (`host_pages`), or both; a node on
  neither tier is removed. Device residency is a prefix of every path: a node on the device has its
  parent on the device (device eviction takes nodes with no device-resident child; loads and inserts
  fill paths top-down). So a match is a device part followed by a host-only part.
- A node with lock_ref > 0 (it, or a descendant, is in use by a running request or an in-flight copy)
  is never evicted from either tier. `lock` and `unlock` walk the path to the root.
- Device eviction of a node that has a host copy keeps it as host-only; of a node without one removes it
  (with its host-only descendants). Host eviction removes host-only, unlocked leaves. Least recently
  used first in both.
- `namespace` (a request's cache_salt) selects a separate root, which seeds its page hash chain.
- Keys are packed int64 bytes (hicache/cache/page_keys.py): a node's run is compared with the query in
  one memcmp, and a divergence is found by bisecting pages with memcmps, so no step loops over pages
  or tokens in Python. Children are keyed by their first page's bytes.
- Recency is a logical clock, so ranks applying the same operations in the same order evict alike.
  Retention hints (retention.py) order eviction by priority before recency, on the arrival clock.
  Eviction candidates are kept across calls (radix_lru.py): O(log tree) per node taken, not O(tree)
  per call; every change that can make a node a candidate, or touches one, offers it there. `peek`
  changes nothing of this (radix_walk.py): arrival and routing only look.
- Every change of a node's pages on a tier is told to `events` (kv_events.py), where it happens.
- Sharded pages (`num_classes` N > 1, hicache/parallel/placement.py): every shard rank keeps this same tree
  with the same logical page ids. A root's subtree has one rotation base (tree_node.py); an insert
  whose base differs from the cached path's is refused whole, never grafted. Evictable device pages
  are counted per owner class (page q in class q mod N), so admission can count the tightest class.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from hicache.cache.kv_events import DEVICE, HOST, KVEventRecorder
from hicache.cache.page_keys import TOKEN_BYTES, Tokens, pack
from hicache.cache.radix_lru import LRUCandidates
from hicache.cache.radix_walk import Peek, matched_runs
from hicache.cache.retention import NO_RETENTION, Retention, RetentionStats, RetentionTimeline
from hicache.cache.tree_node import InsertResult, MatchResult, TreeNode, child_key, split
from hicache.debug.consensus_checker import consensus_checked
from hicache.storage import salt_seed

__all__ = ["InsertResult", "MatchResult", "PagesFn", "Peek", "RadixTree", "TreeNode"]

PagesFn = Callable[[list[int]], None]


class RadixTree:
    def __init__(
        self, page_size: int, on_device_free: PagesFn, on_host_free: PagesFn | None = None, num_classes: int = 1
    ) -> None:
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self.num_classes = num_classes
        self._free_device = on_device_free
        self._free_host = on_host_free
        self._clock = itertools.count(1)
        self._device_lru = LRUCandidates(self._device_leaf)
        self._host_lru = LRUCandidates(self._host_leaf)
        self.retention = RetentionTimeline()
        # The cache's one recorder (kv_events.py); a root's namespace is its cache_salt.
        self.events = KVEventRecorder(page_size, lambda root: next((n for n, r in self._roots.items() if r is root), ""))
        self.reset()

    def reset(self) -> None:
        """Forget everything without freeing pages (the caller resets the pools with it)."""
        self._roots: dict[str, TreeNode] = {}
        self.evictable_pages = 0  # device pages of unlocked nodes
        self.protected_pages = 0  # device pages of locked nodes
        self.evictable_by_class = [0] * self.num_classes
        self.protected_by_class = [0] * self.num_classes
        self._device_lru.clear()
        self._host_lru.clear()
        self.retention.clear()
        self.events.cleared((DEVICE, HOST))

    # ---- queries -------------------------------------------------------------------------------

    def _root(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(b"", [], None)
            root.lock_ref = 1  # roots are never evicted
            root.hashes = [salt_seed(namespace)]  # its pages' hash chain starts from its salt
        return root

    def _child_key(self, key: bytes) -> bytes:
        """The children-dict key of a node's run `key`: its first page."""
        return child_key(key, self._page_bytes)

    def _query(self, tokens: Tokens) -> memoryview:
        """`tokens` packed (page_keys.py), cut to whole pages."""
        query = pack(tokens)
        return query[: len(query) - len(query) % self._page_bytes]

    def match_prefix(
        self, tokens: Tokens, namespace: str = "", count_hit: bool = False, retention: Retention = NO_RETENTION
    ) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens` on either tier. Splits a node when the match
        ends inside it, so every matched node is covered exactly and can be locked. `retention`: the
        matching request's hint, which every matched node takes if higher (retention.py)."""
        path = self._walk(self._query(tokens), namespace)
        now = next(self._clock)
        device_pages: list[int] = []
        last_device = self._root(namespace)
        host_nodes: list[TreeNode] = []
        self.retention.touch_path(path, retention)
        for node in path:
            node.last_access = now
            if count_hit:
                node.hit_count += 1
            if node.on_device and not host_nodes:
                device_pages.extend(node.device_pages)  # type: ignore[arg-type]
                last_device = node
            else:
                host_nodes.append(node)
        # Only these two can be candidates: every other node of the path has a child on it.
        self._device_lru.offer(last_device)
        if host_nodes:
            self._host_lru.offer(host_nodes[-1])
        return MatchResult(device_pages, last_device, host_nodes, self.page_size)

    def peek(self, tokens: Tokens, namespace: str = "") -> Peek:
        """What `match_prefix` would report of `tokens`, changing nothing (radix_walk.py): for arrival
        and routing, which ask what is cached before anything is locked."""
        root = self._roots.get(namespace)  # a namespace never seen gets no root from a look
        runs = matched_runs(root, self._query(tokens), self._page_bytes) if root is not None else ()
        return Peek.of(runs, self.page_size)

    def _walk(self, query: memoryview, namespace: str) -> list[TreeNode]:
        """The nodes covering the longest cached page-aligned prefix of the packed, page-aligned `query`,
        splitting the last one where the match ends inside it."""
        root = self._root(namespace)
        root.last_access = next(self._clock)
        pb = self._page_bytes
        return [node if k * pb == len(node.key) else self._split(node, k) for node, k in matched_runs(root, query, pb)]

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node` after k pages (tree_node.py); the upper part's retention lapses as the lower's."""
        upper = split(node, k, self._page_bytes)
        self.retention.track(upper)
        return upper

    # ---- updates -------------------------------------------------------------------------------

    def _account_device(self, node: TreeNode, sign: int) -> None:
        if node.lock_ref > 0:
            self._protected(node, sign)
        else:
            self._evictable(node, sign)

    def _evictable(self, node: TreeNode, sign: int) -> None:
        """Count a node's device pages in (sign +1) or out of (-1) the evictable ones, by class."""
        self.evictable_pages += sign * len(node.device_pages or [])
        self._by_class(self.evictable_by_class, node, sign)

    def _protected(self, node: TreeNode, sign: int) -> None:
        self.protected_pages += sign * len(node.device_pages or [])
        self._by_class(self.protected_by_class, node, sign)

    def _by_class(self, counts: list[int], node: TreeNode, sign: int) -> None:
        pages = node.device_pages or []
        if self.num_classes == 1:
            counts[0] += sign * len(pages)
            return
        # Counter over a map counts in C: a 1M-token node is ~15k pages.
        for owner, n in Counter(map(self.num_classes.__rmod__, pages)).items():
            counts[owner] += sign * n

    def insert(
        self, tokens: Tokens, pages: list[int], namespace: str = "", rotation: int = 0,
        retention: Retention = NO_RETENTION,
    ) -> InsertResult:  # fmt: skip
        """Cache `tokens` (a page multiple) whose KV lives in device `pages`, placed from rotation base
        `rotation`. Where the tree already has the KV on the device, its pages win and the caller frees
        its own; where it has it only on the host, the caller's pages are attached to the node. Refused
        whole (`refused`, nothing changed but recency) if the cached path has another rotation base.
        `retention`: the inserting request's hint, as for `match_prefix`."""
        query = pack(tokens)
        if len(query) % self._page_bytes or len(pages) * self._page_bytes != len(query):
            raise ValueError("insert needs a page-aligned key and one page per page_size tokens")
        path = self._walk(query, namespace)
        if any(node.rotation != rotation for node in path):
            return InsertResult(list(pages), path[-1], refused=True)
        now = next(self._clock)
        tree_pages: list[int] = []
        for node in path:
            node.last_access = now
            if node.device_pages is None:
                node.device_pages = list(pages[len(tree_pages) : len(tree_pages) + len(node.key) // self._page_bytes])
                self._account_device(node, +1)
                self.events.stored(node, DEVICE)
            tree_pages.extend(node.device_pages)
        parent = path[-1] if path else self._root(namespace)
        new_nodes = []
        if len(tree_pages) < len(pages):
            start = len(tree_pages) * self._page_bytes
            child = TreeNode(bytes(query[start:]), list(pages[len(tree_pages) :]), parent, rotation=rotation)
            child.last_access = now
            parent.children[self._child_key(child.key)] = child
            self._account_device(child, +1)
            self.events.stored(child, DEVICE)
            tree_pages.extend(child.device_pages)  # type: ignore[arg-type]
            new_nodes.append(child)
            parent = child
        self.retention.touch_path(path + new_nodes, retention)
        self._device_lru.offer(parent)  # the path is on the device now: only its end can be a leaf there
        return InsertResult(tree_pages, parent, new_nodes)

    def insert_host(self, tokens: Tokens, host_pages: list[int], namespace: str = "", rotation: int = 0) -> list[int]:
        """Cache the last len(host_pages) pages of `tokens` as host-only KV (read from storage), placed
        from rotation base `rotation`; the rest of `tokens` must already be cached. Returns the host
        pages the tree did not take (the caller frees them): all of them if the prefix is gone or has
        another rotation base, and those the tree already holds."""
        query = self._query(tokens)
        total = len(query) // self._page_bytes
        n_prefix = total - len(host_pages)
        path = self._walk(query, namespace)
        covered = sum(len(n.key) for n in path) // self._page_bytes
        if covered < n_prefix or any(node.rotation != rotation for node in path):
            return list(host_pages)
        rejected: list[int] = []
        pos = 0  # page index along tokens
        for node in path:
            k = len(node.key) // self._page_bytes
            # host_pages[i] is page n_prefix + i: this node's share is pages max(pos, n_prefix)..pos+k-1
            mine = list(host_pages[max(pos, n_prefix) - n_prefix : max(pos + k - n_prefix, 0)])
            if node.host_pages is None and len(mine) == k:
                node.host_pages = mine
                self.events.stored(node, HOST)
            else:
                rejected.extend(mine)
            pos += k
        if covered < total:
            parent = path[-1] if path else self._root(namespace)
            rest = list(host_pages[covered - n_prefix :])
            child = TreeNode(bytes(query[covered * self._page_bytes :]), None, parent, rest, rotation=rotation)
            child.last_access = next(self._clock)
            parent.children[self._child_key(child.key)] = child
            self.events.stored(child, HOST)
            self._host_lru.offer(child)
        return rejected

    def attach_device(self, node: TreeNode, device_pages: list[int]) -> None:
        """A host-only node gets device pages (a load back from the host tier was issued)."""
        assert node.device_pages is None and node.host_pages is not None
        assert node.parent is not None and (node.parent.is_root or node.parent.on_device)
        node.device_pages = list(device_pages)
        self._account_device(node, +1)
        self.events.stored(node, DEVICE)
        self._device_lru.offer(node)

    def lock(self, node: TreeNode) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self._evictable(node, -1)
                self._protected(node, +1)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable(node, +1)
                self._protected(node, -1)
                self._device_lru.offer(node)
                self._host_lru.offer(node)
            node = node.parent  # type: ignore[assignment]

    def detach_device(self, nodes: Iterable[TreeNode]) -> list[int]:
        """Take the device pages of `nodes` and of their device-resident descendants, deepest first, so
        they stay host-only (pages a failed load never filled); a node that is locked, has no host copy
        or keeps a device child keeps its pages, and so do its ancestors. The pages taken, for the
        caller to free."""
        found: dict[int, TreeNode] = {}
        stack = [n for n in nodes if n.on_device]
        while stack:
            node = stack.pop()
            if node.id not in found:
                found[node.id] = node
                stack.extend(c for c in node.children.values() if c.on_device)
        taken: list[int] = []
        for node in sorted(found.values(), key=lambda n: len(self.path_to_root(n)), reverse=True):
            if node.lock_ref > 0 or node.host_pages is None or any(c.on_device for c in node.children.values()):
                continue
            self._account_device(node, -1)
            self.events.removed(node, DEVICE)
            taken.extend(node.device_pages or [])
            node.device_pages = None
            self._host_lru.offer(node)
            self._device_lru.offer(node.parent)  # type: ignore[arg-type]
        return taken

    # ---- eviction ------------------------------------------------------------------------------

    def _device_leaf(self, node: TreeNode) -> bool:
        """A candidate for device eviction."""
        return (
            node.on_device
            and node.lock_ref == 0
            and not node.is_root
            and not any(c.on_device for c in node.children.values())
        )

    @staticmethod
    def _host_leaf(node: TreeNode) -> bool:
        """A candidate for host eviction."""
        return node.host_pages is not None and not node.on_device and node.lock_ref == 0 and not node.children

    @consensus_checked(params=("num_pages",), results=("result",))
    def evict(self, num_pages: int, keep_if: Callable[[TreeNode], bool] | None = None) -> int:
        """Free at least `num_pages` device pages, lowest retention priority first, least recently used
        within one (retention.py; without hints, plain LRU). A node whose KV is on the host (or that
        `keep_if` backs up there, for write-back) stays as host-only; others are removed. Returns the
        number of device pages freed (less when not enough is evictable)."""
        freed = 0
        self.retention.lapse(self._device_lru, self._host_lru)
        while freed < num_pages and (node := self._device_lru.pop()) is not None:
            pages = node.device_pages or []
            self.retention.evicted(node, len(pages), DEVICE)
            self._account_device(node, -1)
            freed += len(pages)
            keep = node.backed_up or (keep_if is not None and keep_if(node))
            self.events.removed(node, DEVICE)
            node.device_pages = None
            self._free_device(pages)
            parent = node.parent
            if keep:
                self._host_lru.offer(node)
            else:
                self._remove_subtree(node)
            self._device_lru.offer(parent)  # type: ignore[arg-type]
        return freed

    def _remove_subtree(self, node: TreeNode) -> None:
        """Unlink `node`; its (host-only) descendants' host pages go back to the host pool."""
        assert node.parent is not None and node.lock_ref == 0
        del node.parent.children[self._child_key(node.key)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert not n.on_device or n is node, "device residency must be a prefix of every path"
            if n.host_pages is not None and self._free_host is not None:
                self.events.removed(n, HOST)
                self._free_host(n.host_pages)
            n.host_pages = None  # gone from both tiers: a stale candidate entry must never look current
            stack.extend(n.children.values())

    @consensus_checked(params=("num_pages",), results=("result",))
    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages from host-only, unlocked leaves, in `evict`'s order."""
        freed = 0
        self.retention.lapse(self._device_lru, self._host_lru)
        while freed < num_pages and (node := self._host_lru.pop()) is not None:
            freed += len(node.host_pages or [])
            self.retention.evicted(node, len(node.host_pages or []), HOST)
            parent = node.parent
            self._remove_subtree(node)
            self._host_lru.offer(parent)  # type: ignore[arg-type]
        return freed

    # ---- inspection ----------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """Non-root nodes from the root down to `node`."""
        path = []
        while node is not None and not node.is_root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        return path[::-1]

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def retention_stats(self) -> RetentionStats:
        """What retention hints hold now and did so far (a walk of the tree: for a metrics scrape)."""
        return self.retention.snapshot(self.nodes(), (self._device_lru.deferred, self._host_lru.deferred))

    @property
    def host_pages_held(self) -> int:
        return sum(len(n.host_pages) for n in self.nodes() if n.host_pages is not None)

    def locked_nodes(self) -> list[TreeNode]:
        return [n for n in self.nodes() if n.lock_ref > 0]
