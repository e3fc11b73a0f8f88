"""radix_trace.py adapter for hicache's RadixTree, kept in the project (../shared/bench/README.md).

Run from ../shared/bench with the project on PYTHONPATH:

    PYTHONPATH=PROJECT:. python radix_trace.py --backends benchmarks.radix_adapter:RadixAdapter,pagehash

It differs from the shared `hicache_adapter.py` in one way: the page-aligned cut of the prompt is a
zero-copy memoryview, not an array slice. The shared adapter's `tokens[:n]` copies the whole prompt
inside the timed region (8 MB and ~2 ms of page faults for the 1M-token prompt) even when it is already
page-aligned, which SGLang's adapter does not do; the tree itself copies the prompt once, into the key it
keeps. Everything else (values: one device page id per page, as the scheduler passes them) is the same.
"""

from __future__ import annotations

from array import array
from typing import Any

from radix_trace import Adapter  # ../shared/bench, on PYTHONPATH

from hicache.cache.radix import RadixTree


class RadixAdapter(Adapter):
    name = "hicache"

    def __init__(self, page_size: int):
        super().__init__(page_size)
        self.tree = RadixTree(page_size, on_device_free=lambda pages: None)

    def make_values(self, n: int, start: int) -> Any:
        p = self.page_size
        return list(range(start // p, (start + n) // p))

    def insert(self, tokens: array, values: Any) -> Any:
        n = len(tokens) // self.page_size * self.page_size
        return self.tree.insert(memoryview(tokens)[:n], values[: n // self.page_size])

    def match(self, tokens: array) -> int:
        return self.tree.match_prefix(tokens).num_tokens

    def size(self) -> int | None:
        return self.tree.total_pages * self.page_size
