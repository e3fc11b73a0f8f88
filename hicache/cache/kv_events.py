"""KV events, recorded (docs/DESIGN.md, "KV events"): what the cache's tiers store and drop, page by page.

The tree, the host tier and the storage puts call the cache's one `KVEventRecorder` at the single
places where a node gains or loses its pages on a tier; a publisher (hicache/events/) drains it once
per scheduler step and sends the batch. A node is all or nothing on a tier, so each call is one node's
pages: its chained page hashes (tree_node.py, the storage keys: seeded by the request's cache_salt)
and the hash of the page before its first. An event costs O(pages changed): hashes are computed once
per node, on its first event. Off (the default, no publisher) a call returns at once.

The records follow vLLM's KV events (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`, with the
parent hash, the pages' token ids and a medium), with our tiers as the media; a chain's first page also
carries its namespace's cache_salt, as vLLM's carries it in `extra_keys`, so a subscriber can hash the
same chain from the tokens alone (hicache/events/wire.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from hicache.cache.tree_node import TreeNode, chain_hashes

DEVICE, HOST, STORAGE = "device", "host", "storage"
MEDIA = (DEVICE, HOST, STORAGE)


@dataclass(frozen=True)
class BlockStored:
    """Pages `block_hashes` (a chain, in order) are now on `medium`; `parent_block_hash` is the page
    before the first (None: the first is its namespace's first page, the chain seeded by `cache_salt`);
    `token_ids` are the pages' tokens, in order."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: array
    medium: str
    cache_salt: str = ""


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page on `media` is gone (a flush: storage keeps its objects)."""

    media: tuple[str, ...]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    def __init__(self, page_size: int, namespace_of: Callable[[TreeNode], str] = lambda root: "") -> None:
        """`namespace_of`: the cache_salt of a namespace's root (the tree's), which its first pages' events carry."""
        self.page_size = page_size
        self.enabled = False  # turned on by the publisher that drains it
        self._events: list[KVEvent] = []
        self.namespace_of = namespace_of

    def stored(self, node: TreeNode, medium: str, pages: Iterable[int] | None = None) -> None:
        """`node`'s pages are now on `medium`: every one of them, or those numbered `pages` (in order;
        a retried put's), one record per run of consecutive pages."""
        if not self.enabled:
            return
        hashes = chain_hashes(node, self.page_size)
        parent = node.parent
        first_page = parent is None or parent.is_root
        prior = None if first_page else chain_hashes(parent, self.page_size)[-1]
        salt = self.namespace_of(parent) if first_page and parent is not None else ""
        tokens = node.tokens
        for start, end in _runs(range(len(hashes)) if pages is None else pages):
            before = hashes[start - 1] if start else prior
            run_tokens = tokens[start * self.page_size : end * self.page_size]
            self._events.append(BlockStored(tuple(hashes[start:end]), before, run_tokens, medium,
                                            salt if before is None else ""))  # fmt: skip

    def removed(self, node: TreeNode, medium: str) -> None:
        """`node`'s pages are gone from `medium`."""
        if self.enabled:
            self._events.append(BlockRemoved(tuple(chain_hashes(node, self.page_size)), medium))

    def removed_pages(self, hashes: list[bytes], medium: str) -> None:
        if self.enabled and hashes:
            self._events.append(BlockRemoved(tuple(hashes), medium))

    def cleared(self, media: tuple[str, ...]) -> None:
        if self.enabled:
            self._events.append(AllBlocksCleared(media))

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, in the order they happened."""
        events, self._events = self._events, []
        return events


def _runs(pages: Iterable[int]) -> Iterator[tuple[int, int]]:
    """[start, end) of each run of consecutive numbers in `pages` (ascending)."""
    start = end = None
    for page in pages:
        if page != end:
            if start is not None:
                yield start, end
            start = page
        end = page + 1
    if start is not None:
        yield start, end  # type: ignore[misc]
