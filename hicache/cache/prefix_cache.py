"""The scheduler's view of the prefix cache: admit a request against what is cached, allocate its
pages, hand its computed pages to the tree, release it. This class is the device tier (a radix cache);
`HierarchicalCache` adds the host and storage tiers through the hooks marked below.

Lease contract: a request holds exactly one tree lock (`req.lock_node`) from admission to release;
moving it deeper (after its prompt is cached) locks the new node before unlocking the old one.
"""

from __future__ import annotations

import logging
from typing import Callable

from hicache.cache.radix import MatchResult, RadixTree, TreeNode
from hicache.debug.consensus_checker import consensus_checked
from hicache.engine.request import Request
from hicache.mem.device_pool import DeviceKVPool

logger = logging.getLogger(__name__)

# What must agree across ranks about an admission: its inputs, the decision, the matched length by tier.
ADMIT_PARAMS = ("req.rid", "total_pages", "reserved_elsewhere")
ADMIT_RESULTS = ("result", "req.kv_len", "req.cached_tokens_by_tier", "req.reserved_pages")
RELEASE_PARAMS = ("req.rid", "req.kv_len")


class PrefixCache:
    def __init__(self, pool: DeviceKVPool, enabled: bool = True) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.page_size = pool.page_size
        self.enabled = enabled
        self.tree = RadixTree(self.page_size, on_device_free=self.allocator.free, on_host_free=self._free_host)

    # ---- hooks for the hierarchical tiers ------------------------------------------------------

    def _free_host(self, pages: list[int]) -> None:
        raise RuntimeError("no host tier")

    def on_arrival(self, req: Request) -> None:
        """A request entered the waiting queue."""

    def ready_to_admit(self, req: Request, busy: bool) -> bool:
        """False while the request waits for something (a storage prefetch). `busy`: other requests
        are running, so waiting would not leave the engine idle."""
        return True

    def _load_back(self, req: Request, match: MatchResult, budget: int) -> TreeNode:
        """Make (part of) a host-resident match usable on the device; returns the deepest node whose
        KV is (or is being made) device-resident. The device tier has nothing to load."""
        return match.last_device_node

    def _on_new_nodes(self, nodes: list[TreeNode]) -> None:
        """Nodes were just created on the device tier (write-through backs them up)."""

    def _keep_on_evict(self, node: TreeNode) -> bool:
        """Called for a node leaving the device without a host copy; True if it was backed up now."""
        return False

    def check(self) -> None:
        """Consume completed asynchronous transfers (a scheduler check point)."""

    def before_layer(self) -> Callable[[int], None] | None:
        return None

    # ---- admission and lifetime ----------------------------------------------------------------

    def available_pages(self) -> int:
        return self.allocator.free_pages + self.tree.evictable_pages

    @consensus_checked(params=ADMIT_PARAMS, results=ADMIT_RESULTS)
    def admit(self, req: Request, total_pages: int, reserved_elsewhere: int) -> bool:
        """Match and lock the request's cached prefix if the pages it may still need fit; sets
        req.pages, req.kv_len, req.lock_node, req.reserved_pages and its hits by tier."""
        if not self.enabled:
            if total_pages > self.available_pages() - reserved_elsewhere:
                return False
            req.reserved_pages = total_pages
            return True
        # At least the last prompt token is always computed: its logits give the first output token.
        match = self.tree.match_prefix(req.prompt_ids[: req.prompt_len - 1], req.namespace, count_hit=True)
        self.tree.lock(match.last_node)  # also keeps a host-resident continuation from host eviction
        need = total_pages - len(match.device_pages)
        if need > self.available_pages() - reserved_elsewhere:
            self.tree.unlock(match.last_node)
            return False
        req.pages = list(match.device_pages)
        req.cached_tokens_by_tier["device"] = match.num_tokens
        deepest = self._load_back(req, match, need)
        self.tree.lock(deepest)
        self.tree.unlock(match.last_node)
        req.lock_node = deepest
        req.kv_len = len(req.pages) * self.page_size
        req.reserved_pages = total_pages - len(req.pages)
        return True

    @consensus_checked(params=("n",), results=("result",))
    def alloc(self, n: int) -> list[int]:
        """n device pages, evicting unlocked cache if needed. Callers only ask for what admission
        reserved, so this cannot fail."""
        short = n - self.allocator.free_pages
        if short > 0 and self.enabled:
            self.tree.evict(short, keep_if=self._keep_on_evict)
        pages = self.allocator.alloc(n)
        if pages is None:
            raise RuntimeError("KV reservation invariant broken: an admitted request could not allocate")
        return pages

    def cache_prefix(self, req: Request, upto: int) -> None:
        """Hand the request's full pages of tokens [0, upto) to the tree and move its lock there."""
        n = upto - upto % self.page_size
        if not self.enabled or n == 0:
            return
        res = self.tree.insert(req.tokens(n), req.pages[: n // self.page_size], req.namespace)
        for i, page in enumerate(res.pages):
            if req.pages[i] != page:
                # Someone cached the same tokens first: use their page, return our duplicate.
                self.allocator.free([req.pages[i]])
                req.pages[i] = page
        self.tree.lock(res.last_node)
        assert req.lock_node is not None
        self.tree.unlock(req.lock_node)
        req.lock_node = res.last_node
        self._on_new_nodes(res.new_nodes)

    @consensus_checked(params=RELEASE_PARAMS, results=())
    def release(self, req: Request) -> None:
        """The request ended: cache what it computed, drop its lock, free the rest of its pages."""
        kept = 0
        if self.enabled and req.lock_node is not None:
            self.cache_prefix(req, req.kv_len)
            self.tree.unlock(req.lock_node)
            req.lock_node = None
            kept = req.kv_len // self.page_size
        self.allocator.free(req.pages[kept:])
        req.pages = []

    # ---- maintenance ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Drop every cached prefix on every in-memory tier (storage keeps its objects)."""
        self.check()
        self.tree.evict(self.tree.total_pages)
        self.tree.reset()

    def leak_report(self) -> list[str]:
        problems = []
        if self.allocator.free_pages != self.allocator.num_pages:
            problems.append(f"{self.allocator.num_pages - self.allocator.free_pages} device pages not freed")
        if self.tree.locked_nodes():
            problems.append(f"locked nodes: {self.tree.locked_nodes()}")
        return problems

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, capacity) in tokens per tier."""
        a = self.allocator
        return {"device": (a.used_pages * a.page_size, a.num_pages * a.page_size)}

    def stats(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        """Stop background work (the hierarchical tiers' workers)."""
