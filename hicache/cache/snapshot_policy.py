"""Which recurrent-state snapshots the cache keeps (docs/DESIGN.md, "Hybrid models"): a hit on a hybrid model
with linear-attention layers must end where the state after its prefix is kept, since no part of the prefix
rebuilds it. `--mamba-track-interval` (SGLang's flag) says where:

- every `interval_pages` pages of a prefix (one page: every page boundary, the default);
- 0: only at a turn's end, the page boundary at the end of what a finished request cached (SGLang's
  `no_buffer` keeps a request's state at its end alone); the tree marks that node's end (`snapshot_end`).

`tiny-hybrid` writes its snapshot at every page boundary into row columns the recurrent layer leaves unused,
so keeping fewer saves it nothing; the policy is what a hit may use, as it would be for a real hybrid whose
state is megabytes a snapshot (docs/BENCHMARKS.md: the bytes each policy would cost, computed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hicache.cache.tree_node import TreeNode


@dataclass(frozen=True)
class SnapshotPolicy:
    interval_pages: int  # snapshots kept every this many pages; 0: at a turn's end only

    @property
    def turn_end(self) -> bool:
        return self.interval_pages == 0

    def last_kept(self, limit: int, path: Iterable[tuple[TreeNode, int]]) -> int:
        """The last page boundary at or before `limit` (pages from the root) where a snapshot is kept, along
        `path`: the matched nodes from the root down, each with how many of its leading pages match."""
        if not self.turn_end:
            return limit - limit % self.interval_pages
        kept = end = 0
        for node, matched in path:
            end += matched
            if end > limit:
                break
            if node.snapshot_end and matched == node.num_pages:
                kept = end
        return kept
