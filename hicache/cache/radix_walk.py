"""The walk along a query's cached prefix in the radix tree (radix.py), read only, and what a peek reports.

A match and an insert take the walk and split the node where the match ends inside it, so every node
they go on to lock or fill is covered exactly. Arrival and routing only ask how much is cached
(docs/DESIGN.md, "cache API"): `RadixTree.peek` counts the same walk, the pages matched inside the last
node included, and changes nothing (no split, no recency, no hit, no eviction candidate offered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from hicache.cache.page_keys import common_pages
from hicache.cache.tree_node import TreeNode


def matched_runs(root: TreeNode, query: memoryview, page_bytes: int) -> Iterator[tuple[TreeNode, int]]:
    """The nodes below `root` covering the longest cached page-aligned prefix of the packed,
    page-aligned `query`, each with how many of its leading pages match: all but perhaps the last
    node's. Reads only; the caller may split a node it is given before it asks for the next."""
    node, pos = root, 0
    while pos < len(query):
        child = node.children.get(bytes(query[pos : pos + page_bytes]))  # children are keyed by first page
        if child is None:
            return
        # The first page is equal (it is the dict key); common_pages checks it again in the same memcmp.
        k = common_pages(child.key, query, pos, page_bytes)
        ends_inside = k * page_bytes < len(child.key)  # decided before the caller may split `child`
        yield child, k
        if ends_inside:
            return
        pos += k * page_bytes
        node = child


@dataclass(frozen=True)
class Peek:
    """What `RadixTree.match_prefix` would report of a query, in counts: nothing to lock or load."""

    device_pages: int  # the device-resident prefix
    host_pages: int  # the host-only pages continuing it
    rotation: int | None  # the matched path's rotation base; None when nothing matched (a new prefix)
    page_size: int
    # The matched nodes from the root down, each with how many of its leading pages match: what a hybrid
    # model's hit rules read (hicache/cache/prefix_cache.py), not to change.
    path: tuple[tuple[TreeNode, int], ...] = ()

    @classmethod
    def of(cls, runs: Iterable[tuple[TreeNode, int]], page_size: int) -> Peek:
        device = host = 0
        rotation = None
        path = tuple(runs)
        for node, k in path:
            if node.on_device and not host:  # device residency is a prefix of the path; the rest is host-only
                device += k
            else:
                host += k
            rotation = node.rotation  # one per root's subtree (tree_node.py)
        return cls(device, host, rotation, page_size, path)

    @property
    def device_tokens(self) -> int:
        return self.device_pages * self.page_size

    @property
    def host_tokens(self) -> int:
        return self.host_pages * self.page_size
