"""The radix tree's records (docs/DESIGN.md, "radix tree"): a node, and what a match and an insert return.

A node is a page-aligned run of tokens with its KV on the device (`device_pages`), on the host
(`host_pages`), or both. `rotation` is the owner class of its prefix's first page when pages are
sharded over N ranks (hicache/parallel/placement.py): page P of the path from the root lives on class
(rotation + P) mod N, so every node of a root's subtree carries the same rotation (a split copies it
to both halves, an insert that would mix two is refused). At N = 1 it is always 0.

`key` is the node's run packed as int64 bytes (hicache/cache/page_keys.py); `tokens` unpacks it.
`hashes` are its pages' chained storage hashes (hicache/storage/keys.py), computed once, when storage or
the KV events first need them; a root's is the chain's seed, its namespace's `salt_seed`.
"""

from __future__ import annotations

import itertools
import math
from array import array
from dataclasses import dataclass, field
from itertools import chain

from hicache.cache.page_keys import num_tokens, unpack
from hicache.storage import page_hashes


class TreeNode:
    __slots__ = (
        "key", "device_pages", "host_pages", "hashes", "children", "parent",
        "lock_ref", "last_access", "hit_count", "backup_pending", "id", "rotation", "priority", "retain_until",
        "snapshot_end",
    )  # fmt: skip

    _ids = itertools.count()

    def __init__(
        self,
        key: bytes,
        device_pages: list[int] | None,
        parent: "TreeNode | None",
        host_pages: list[int] | None = None,
        rotation: int = 0,
    ) -> None:
        self.key = key
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.hashes: list[bytes] | None = None  # storage page hashes, computed when first needed
        self.children: dict[bytes, TreeNode] = {}  # by the child's first page (packed)
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.backup_pending = False  # host_pages assigned, device -> host copy not yet acknowledged
        self.id = next(TreeNode._ids)
        self.rotation = rotation
        # Its retention (retention.py): evicted after every node of lower priority, until retain_until
        # on the arrival clock; 0 (plain LRU) without hints.
        self.priority = 0
        self.retain_until = math.inf
        # A hybrid's recurrent state after the node's last page is kept under the `turn-end` snapshot policy
        # (hicache/cache/snapshot_policy.py): a request that finished here cached it. A split's upper part
        # ends elsewhere, so it starts without.
        self.snapshot_end = False

    @property
    def num_tokens(self) -> int:
        return num_tokens(self.key)

    @property
    def tokens(self) -> array:
        """The node's token ids (a copy), e.g. for storage hashing."""
        return unpack(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def backed_up(self) -> bool:
        return self.host_pages is not None and not self.backup_pending

    @property
    def num_pages(self) -> int:
        return len(self.device_pages if self.device_pages is not None else self.host_pages or [])

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, lock_ref={self.lock_ref}, "
            f"device={self.device_pages is not None}, host={self.host_pages is not None})"
        )


def child_key(key: bytes, page_bytes: int) -> bytes:
    """The key a node of run `key` has among its parent's children: its first page."""
    return bytes(key[:page_bytes])


def split(node: TreeNode, k: int, page_bytes: int) -> TreeNode:
    """Cut `node` after k pages (of `page_bytes` key bytes each); the new upper part, holding the first
    k pages on each tier and every other field of the node, takes its place under the parent."""
    n_bytes = k * page_bytes
    assert 0 < n_bytes < len(node.key) and node.parent is not None
    upper = TreeNode(
        node.key[:n_bytes],
        None if node.device_pages is None else node.device_pages[:k],
        node.parent,
        None if node.host_pages is None else node.host_pages[:k],
        rotation=node.rotation,
    )
    if node.hashes is not None:
        upper.hashes, node.hashes = node.hashes[:k], node.hashes[k:]
    upper.lock_ref = node.lock_ref
    upper.last_access = node.last_access
    upper.hit_count = node.hit_count
    upper.backup_pending = node.backup_pending
    upper.priority, upper.retain_until = node.priority, node.retain_until
    node.parent.children[child_key(node.key, page_bytes)] = upper
    node.key = node.key[n_bytes:]
    if node.device_pages is not None:
        node.device_pages = node.device_pages[k:]
    if node.host_pages is not None:
        node.host_pages = node.host_pages[k:]
    node.parent = upper
    upper.children[child_key(node.key, page_bytes)] = node
    return upper


def chain_hashes(node: TreeNode, page_size: int) -> list[bytes]:
    """The chained page hashes of a non-root node's pages, each continuing its parent's chain (seeded by
    its root: its namespace's salt), computed once per node: down from the nearest ancestor that has
    them, so the cost is one SHA-256 per page never hashed before, whatever the depth."""
    unhashed = []
    while node.hashes is None:
        unhashed.append(node)
        node = node.parent  # type: ignore[assignment]  # a root always has its seed
    prior = node.hashes[-1]
    for n in reversed(unhashed):
        n.hashes = page_hashes(n.tokens, page_size, prior)
        prior = n.hashes[-1]
    return unhashed[0].hashes if unhashed else node.hashes  # type: ignore[return-value]


@dataclass(frozen=True)
class MatchResult:
    device_pages: list[int]  # the device-resident prefix
    last_device_node: TreeNode
    host_nodes: list[TreeNode]  # host-only nodes continuing the match, in path order
    page_size: int

    @property
    def num_tokens(self) -> int:
        """Tokens usable without any copy."""
        return len(self.device_pages) * self.page_size

    @property
    def host_pages(self) -> list[int]:
        return list(chain.from_iterable(n.host_pages or () for n in self.host_nodes))

    @property
    def host_tokens(self) -> int:
        return sum(len(n.host_pages or ()) for n in self.host_nodes) * self.page_size

    @property
    def last_node(self) -> TreeNode:
        return self.host_nodes[-1] if self.host_nodes else self.last_device_node

    @property
    def rotation(self) -> int | None:
        """The matched path's rotation base; None when nothing matched (a new prefix)."""
        return None if self.last_node.is_root else self.last_node.rotation


@dataclass(frozen=True)
class InsertResult:
    pages: list[int]  # the tree's device pages for the whole key; the caller frees its own that differ
    last_node: TreeNode
    new_nodes: list[TreeNode] = field(default_factory=list)  # created by this insert, top-down
    # The cached path has another rotation base than the caller's pages: nothing was inserted (the
    # caller keeps its own pages), since grafting would break the owner cycle along the path.
    refused: bool = False
