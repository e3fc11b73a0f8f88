"""Radix prefix tree over page-aligned token runs, mapping cached prefixes to logical KV pages.

Contracts:
- Keys are cut at page boundaries: every node's key length is a multiple of the page size, so a match
  is always a whole number of pages and a node's pages are exactly its tokens' KV.
- A node with lock_ref > 0 (it, or a descendant, is in use by a running request) is never evicted.
  `lock` and `unlock` walk the path to the root; every lock is released on every path by its owner.
- Eviction removes least-recently-used unlocked leaves and hands their pages to `on_evict`.
- `namespace` (a request's cache_salt) selects a separate root: different salts never share pages.
- Recency is a logical clock, not wall time, so ranks that apply the same operations in the same
  order make the same eviction choices.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence


class TreeNode:
    __slots__ = ("key", "device_pages", "children", "parent", "lock_ref", "last_access", "hit_count", "id")

    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...], device_pages: list[int], parent: "TreeNode | None") -> None:
        self.key = key
        self.device_pages = device_pages
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.id = next(TreeNode._ids)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    device_pages: list[int]
    last_node: TreeNode
    page_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.device_pages) * self.page_size


@dataclass(frozen=True)
class InsertResult:
    existing_tokens: int  # leading tokens the tree already held (their pages are the tree's, not the caller's)
    pages: list[int]  # the tree's pages for the whole key after insertion
    last_node: TreeNode


class RadixTree:
    def __init__(self, page_size: int, on_evict: Callable[[list[int]], None]) -> None:
        self.page_size = page_size
        self._on_evict = on_evict
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget everything without freeing pages (the caller resets the pool with it)."""
        self._roots: dict[str, TreeNode] = {}
        self.evictable_pages = 0
        self.protected_pages = 0

    # ---- queries -------------------------------------------------------------------------------

    def _root(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode((), [], None)
            root.lock_ref = 1  # roots are never evicted
        return root

    def _page_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`. Splits a node when the match ends inside it,
        so the returned last_node covers exactly the matched prefix and can be locked."""
        tokens = tuple(tokens[: self._aligned(len(tokens))])
        node = self._root(namespace)
        now = next(self._clock)
        node.last_access = now
        pages: list[int] = []
        pos = 0
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos) * self.page_size
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.device_pages)
            pos += n
            node = child
        return MatchResult(pages, node, self.page_size)

    def _common_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        p = self.page_size
        n = 0
        limit = min(len(key), len(tokens) - pos) // p
        while n < limit and key[n * p : (n + 1) * p] == tokens[pos + n * p : pos + (n + 1) * p]:
            n += 1
        return n

    def _split(self, node: TreeNode, n_tokens: int) -> TreeNode:
        """Cut `node` after n_tokens; the new upper part takes its place under the parent."""
        assert 0 < n_tokens < len(node.key) and n_tokens % self.page_size == 0
        n_pages = n_tokens // self.page_size
        upper = TreeNode(node.key[:n_tokens], node.device_pages[:n_pages], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        assert node.parent is not None
        node.parent.children[self._page_key(node.key, 0)] = upper
        node.key = node.key[n_tokens:]
        node.device_pages = node.device_pages[n_pages:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    # ---- updates -------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: list[int], namespace: str = "") -> InsertResult:
        """Cache `tokens` (a page multiple) whose KV lives in `pages`. Pages for a part the tree already
        holds stay the caller's to free; the rest now belong to the tree."""
        if len(tokens) % self.page_size or len(pages) * self.page_size != len(tokens):
            raise ValueError("insert needs a page-aligned key and one page per page_size tokens")
        tokens = tuple(tokens)
        match = self.match_prefix(tokens, namespace)
        node = match.last_node
        existing = match.num_tokens
        if existing < len(tokens):
            new_pages = pages[existing // self.page_size :]
            child = TreeNode(tokens[existing:], list(new_pages), node)
            child.last_access = next(self._clock)
            node.children[self._page_key(child.key, 0)] = child
            # A new leaf is unlocked unless an ancestor's lock covers it: locks are per path, and the
            # new leaf is not on any locked path yet.
            self.evictable_pages += len(new_pages)
            node = child
        return InsertResult(existing, match.device_pages + pages[existing // self.page_size :], node)

    def lock(self, node: TreeNode) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.device_pages)
                self.protected_pages += len(node.device_pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.device_pages)
                self.protected_pages -= len(node.device_pages)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, least recently used first. Returns the
        number freed (less when not enough is evictable)."""
        heap = [(n.last_access, n.id, n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._page_key(node.key, 0)]
            self.evictable_pages -= len(node.device_pages)
            freed += len(node.device_pages)
            self._on_evict(node.device_pages)
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # ---- inspection ----------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def locked_nodes(self) -> list[TreeNode]:
        return [n for n in self.nodes() if n.lock_ref > 0]
