"""Where a hit may end on a hybrid model (docs/DESIGN.md, "Hybrid models"): only where the window KV before
its end is held (sliding_tier.py) and where the state of its recurrent layers is kept (snapshot_policy.py).
`match` cuts a match to that; `lookup` (arrival and routing, which only look) reports the same cut, changing
nothing; `ended` marks a finished request's turn end and frees the window KV no hit reaches any more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.cache.api import PrefixMatch
from hicache.cache.page_keys import Tokens
from hicache.cache.radix import Peek, RadixTree, TreeNode
from hicache.cache.sliding_tier import SlidingWindowTier
from hicache.cache.snapshot_policy import SnapshotPolicy

Path = Sequence[tuple[TreeNode, int]]  # matched nodes from the root down, each with its leading pages matched


def device_part(path: Path) -> Path:
    """The device-resident nodes of a matched `path` (residency is a prefix of a path)."""
    return path[: next((i for i, (node, _) in enumerate(path) if not node.on_device), len(path))]


class HybridHits:
    def __init__(self, tree: RadixTree, sliding: SlidingWindowTier | None, snapshots: SnapshotPolicy | None,
                 free_device: Callable[[list[int]], None]) -> None:  # fmt: skip
        self.tree = tree
        self.sliding = sliding
        self.snapshots = snapshots
        self.page_size = tree.page_size
        self._free_device = free_device

    def _path(self, last: TreeNode) -> list[tuple[TreeNode, int]]:
        return [(node, node.num_pages) for node in self.tree.path_to_root(last)]

    def _kept(self, path: Path) -> Callable[[int], int]:
        """The last page boundary at or before a limit where a hit along `path` may end for its state."""
        snapshots = self.snapshots
        return (lambda limit: limit) if snapshots is None else (lambda limit: snapshots.last_kept(limit, path))

    def hit_pages(self, path: Path, device_runs: Path) -> tuple[int, int]:
        """Of a match along `path` whose device part is `device_runs`: the pages a hit may use, and the pages
        the window rule cut from where the snapshot policy let it end."""
        total, kept = sum(k for _, k in path), self._kept(path)
        if self.sliding is None:
            return kept(total), 0
        device_pages = [p for node, k in device_runs for p in (node.device_pages or [])[:k]]
        valid = self.sliding.valid_pages(device_pages, total - len(device_pages), kept)
        return valid, kept(total) - valid

    def match(self, tokens: Tokens, namespace: str) -> tuple[int, int]:
        """The pages of `tokens`' cached prefix a hit may use and the pages the window rule cut (`hit_pages`),
        after taking off the device a backed-up node whose window KV was freed (sliding_tier.py's
        `reload_from`: the hit goes on through its host copy). Splits nodes, counts no hit."""
        path = self._path(self.tree.match_prefix(tokens, namespace).last_node)
        device_runs = device_part(path)
        if self.sliding is not None and (reload := self.sliding.reload_from(device_runs)) is not None:
            self._free_device(self.tree.detach_device([device_runs[reload][0]]))
            path = self._path(self.tree.match_prefix(tokens, namespace).last_node)
            device_runs = device_part(path)
        return self.hit_pages(path, device_runs)

    def lookup(self, peek: Peek) -> PrefixMatch:
        """What `match` would admit of a peeked prefix, changing nothing: a node it would reload counts as
        host pages."""
        device_runs = device_part(peek.path)
        if self.sliding is not None and (reload := self.sliding.reload_from(device_runs)) is not None:
            device_runs = device_runs[:reload]
        device = sum(k for _, k in device_runs)
        hit, _ = self.hit_pages(peek.path, device_runs)
        return PrefixMatch(device=min(hit, device) * self.page_size, host=max(0, hit - device) * self.page_size)

    def ended(self, last_node: TreeNode, own_from: int, cached_pages: int) -> None:
        """A request that cached `cached_pages` pages along the path to `last_node`, computing those from page
        `own_from` on, has ended: under the turn-end policy its state there is kept, and its pages' window KV
        more than a window before the last boundary where a hit may end goes."""
        if self.snapshots is not None and self.snapshots.turn_end and not last_node.is_root:
            last_node.snapshot_end = True
        if self.sliding is not None:
            self.sliding.trim(last_node, own_from, self._kept(self._path(last_node))(cached_pages))
