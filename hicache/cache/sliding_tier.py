"""The sliding-window pages as the radix tree holds them (docs/DESIGN.md, "Hybrid models"): a hybrid model's
sliding layers need a cached prefix's window KV only for the last W - 1 tokens before wherever a hit may
end, so the tree keeps the full layers' pages of every node and sliding pages (hicache/mem/sliding_pool.py)
only where a request can still need them; a page without them is a tombstone for the sliding layers.

- Every device page allocated gets a sliding page: a running request holds its whole sequence's window KV
  (its lock keeps the tree's pages it matched from losing theirs), and a host -> device load restores the
  window rows with the rest of the row.
- When a request ends, its own cached pages (after the prefix it matched) more than a window before the last
  page boundary of what it cached where a hit may end (the snapshot policy's) give their sliding pages
  back (`trim`), where no other running request holds them. With a host tier this waits until the node
  is backed up, so the host and storage only ever hold whole rows.
- Under pressure the sliding pool evicts on its own (`make_room`): the sliding pages of unlocked nodes go,
  lowest retention priority and least recently used first (backed-up nodes only, with a host tier, else the
  full eviction of the device tier frees both).
- The match rule (`valid_pages`): a hit of k pages is served only if the pages its first new token's window
  reaches (the last `window_pages` before k) hold their window KV (host pages always do); else it shrinks
  to the longest k where that holds (and where the snapshot policy keeps a state, with recurrent layers).
  With a host tier, a backed-up node there first leaves the device (`reload_from`), so the hit goes on
  through the host part and a load back restores the window.
  Host and storage pages hold whole rows: a node with a page whose window KV was freed before it was
  backed up (a P/D decode server's received pages before the last window) gets no host copy.
  Recomputing the window instead would need each sliding layer's input over the window, which needs the
  window before it: W more tokens per sliding layer, not W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.cache.radix import RadixTree, TreeNode
from hicache.mem.sliding_pool import SlidingPages


class SlidingWindowTier:
    def __init__(self, pages: SlidingPages, tree: RadixTree, host_backed: bool) -> None:
        """`host_backed`: a host tier keeps copies of the device's nodes, so a node's window KV is freed
        only once its copy (a whole row) is taken."""
        self.pages = pages
        self.tree = tree
        self.host_backed = host_backed
        # Pages before a hit's end that its first new token's window reaches (W - 1 tokens before it).
        self.window_pages = -(-(pages.window - 1) // pages.page_size)
        self.freed_at_release = 0  # sliding pages `trim` gave back
        self.evicted = 0  # sliding pages `make_room` took from the tree
        self.shrunk_hits = 0  # matches cut short by the window rule, and the pages they lost
        self.shrunk_pages = 0

    def _may_free(self, node: TreeNode) -> bool:
        return node.on_device and node.lock_ref == 0 and (not self.host_backed or node.backed_up)

    # ---- the match rule ------------------------------------------------------------------------

    def valid_pages(self, device_pages: list[int], host_pages: int, kept: Callable[[int], int]) -> int:
        """The longest prefix (in pages) of a match of `device_pages` then `host_pages` host pages whose window
        KV is all there, ending where `kept` (the last page boundary at or before a limit where the hit may
        end: the snapshot policy's) allows."""
        held = self.pages.held(device_pages) + [True] * host_pages
        end = kept(len(held))
        while end > 0:
            start = max(0, end - self.window_pages)
            missing = [i for i in range(start, end) if not held[i]]
            if not missing:
                break
            end = kept(missing[-1])  # every end after it still reaches it
        return end

    def admitted(self, lost_pages: int) -> None:
        """A request was admitted with a hit `lost_pages` shorter than the cached prefix (counted once, not
        at every admission a waiting request tries)."""
        if lost_pages:
            self.shrunk_hits += 1
            self.shrunk_pages += lost_pages

    def reload_from(self, device_runs: Sequence[tuple[TreeNode, int]]) -> int | None:
        """With a host tier: of the matched device part `device_runs` (its nodes from the root down, each with
        how many of its leading pages match), the index of the first node holding a page whose window KV was
        freed among the last window before the device part's end, where that node is backed up (its host
        copy has whole rows: taken off the device with what follows it, a load back restores the window)."""
        if not self.host_backed:
            return None
        end, first = sum(k for _, k in device_runs), 0
        for i, (node, k) in enumerate(device_runs):
            pages = (node.device_pages or [])[:k]
            lo = max(first, end - self.window_pages)
            if lo < first + len(pages) and not all(self.pages.held(pages[lo - first :])):
                return i if node.backed_up and node.lock_ref == 0 else None
            first += len(pages)
        return None

    # ---- freeing -------------------------------------------------------------------------------

    def trim(self, last_node: TreeNode, own_from: int, kept_end: int) -> None:
        """A request that cached pages along the path to `last_node`, computing those from page `own_from` on,
        has ended, the last page boundary of them where a hit may end (a kept snapshot's) at `kept_end`: its
        pages more than a window before that give back their sliding pages, in nodes no running request
        holds."""
        stop = kept_end - self.window_pages
        first = 0
        for node in self.tree.path_to_root(last_node):
            pages = node.device_pages or []
            lo, hi = max(first, own_from), min(first + len(pages), stop)
            if hi > lo and self._may_free(node):
                self.freed_at_release += self.pages.release(pages[lo - first : hi - first])
            first += len(pages)

    def landed(self, pages: list[int], start: int, end: int) -> None:
        """Rows of tokens [start, end) of a request's `pages` came from another server (a P/D prefill's), whose
        window KV is sure only for the last window before `end` (the window its own hit rule kept): the
        rest of those pages give their sliding pages back, tombstones from the start."""
        keep_from = max(start, end - (self.pages.window - 1)) // self.pages.page_size
        self.freed_at_release += self.pages.release(pages[start // self.pages.page_size : keep_from])

    def freeable_pages(self) -> int:
        """Sliding pages the tree holds in unlocked nodes (a walk of the tree: only asked under pressure)."""
        return sum(sum(self.pages.held(n.device_pages or [])) for n in self.tree.nodes() if n.lock_ref == 0)

    def room(self, n: int, promised: int) -> bool:
        """Whether `n` more sliding pages fit, besides the `promised` ones admitted requests may still take:
        every unlocked node's sliding pages can be freed (its own eviction or the device tier's)."""
        free = self.pages.allocator.free_pages
        return n + promised <= free or n + promised <= free + self.freeable_pages()

    def make_room(self, n: int, evict_device: Callable[[int], int]) -> None:
        """Free sliding pages until `n` are free: the tree's least recently used first, then (nodes not
        backed up yet, with a host tier) through the device tier's eviction, which frees both."""
        allocator = self.pages.allocator
        if allocator.free_pages >= n:
            return
        candidates = sorted(
            (node for node in self.tree.nodes() if self._may_free(node)), key=lambda x: (x.priority, x.last_access)
        )
        for node in candidates:
            if allocator.free_pages >= n:
                return
            self.evicted += self.pages.release(node.device_pages or [])
        while allocator.free_pages < n:
            if evict_device(n - allocator.free_pages) == 0:
                raise RuntimeError("KV reservation invariant broken: no sliding-window pages left to free")
