"""The CP gather's scratch in the admission budget (docs/DESIGN.md, "CP page sharding"): with pages
sharded over N ranks, each layer's attention first gathers the prefix pages of every running request
into a scratch buffer (hicache/model/attention/kv_gather.py) holding at most `capacity` pages per owner class
(`--cp-gather-tokens`). Admission keeps every step's gather within it.

What a step gathers is, per owner class, distinct pages of READY requests: tree pages they hold locked
(counted by the tree, `protected_by_class`) or pages of their own not shared yet (`private_by_class`,
kept here), and later only pages they were promised (`reserved_by_class`). So a request is admitted
only if, in every class, those three and its own new pages fit the capacity. Every term is mirrored
state, the same on every shard rank. Without a capacity the scratch holds a whole layer of the logical
pool and nothing can overflow it: the pool's own admission check is the budget.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from hicache.cache.radix import RadixTree
from hicache.mem.device_pool import DeviceKVPool


class GatherBudget:
    def __init__(self, pool: DeviceKVPool, tree: RadixTree) -> None:
        self.capacity = pool.gather_pages  # pages per owner class; None: the whole pool
        self.tree = tree
        self.placement = pool.placement
        self.private_by_class = [0] * pool.allocator.num_classes

    def fits(self, classes: Sequence[int], reserved_by_class: Sequence[int]) -> bool:
        """Whether new pages of `classes` keep every class's gather within the capacity."""
        if self.capacity is None:
            return True
        wanted = Counter(classes)
        locked, private = self.tree.protected_by_class, self.private_by_class
        return all(
            locked[c] + private[c] + reserved_by_class[c] + wanted.get(c, 0) <= self.capacity
            for c in range(len(private))
        )

    def hold(self, rotation: int, first: int, n: int, sign: int) -> None:
        """Pages first..first+n-1 of a READY request's path become (+1) or stop being (-1) its own."""
        for c in self.placement.rotation_classes(rotation, first, n):
            self.private_by_class[c] += sign
