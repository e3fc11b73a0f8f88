"""KV events, recorded (docs/DESIGN.md, "KV events"): what the cache's tiers store and drop, page by page.

The tree, the host tier and the storage puts call the cache's one `KVEventRecorder` at the single
places where a node gains or loses its pages on a tier; a publisher (hicache/events/) drains it once
per scheduler step and sends the batch. A node is all or nothing on a tier, so each call is one node's
pages: its chained page hashes (tree_node.py, the storage keys: seeded by the request's cache_salt)
and the hash of the page before its first. An event costs O(pages changed): hashes are computed once
per node, on its first event. Off (the default, no publisher) a call returns at once.

The records follow vLLM's KV events (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`, with the
parent hash and a medium), with our tiers as the media.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.cache.tree_node import TreeNode, chain_hashes

DEVICE, HOST, STORAGE = "device", "host", "storage"
MEDIA = (DEVICE, HOST, STORAGE)


@dataclass(frozen=True)
class BlockStored:
    """Pages `block_hashes` (a chain, in order) are now on `medium`; `parent_block_hash` is the page
    before the first (None: the first is a prompt's first page, or not known for a retried put)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_count: int
    medium: str


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
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.enabled = False  # turned on by the publisher that drains it
        self._events: list[KVEvent] = []

    def stored(self, node: TreeNode, medium: str) -> None:
        """`node`'s pages are now on `medium` (every one of them)."""
        if self.enabled:
            hashes = chain_hashes(node, self.page_size)
            parent = node.parent
            prior = None if parent is None or parent.is_root else chain_hashes(parent, self.page_size)[-1]
            self._events.append(BlockStored(tuple(hashes), prior, len(hashes) * self.page_size, medium))

    def removed(self, node: TreeNode, medium: str) -> None:
        """`node`'s pages are gone from `medium`."""
        if self.enabled:
            self._events.append(BlockRemoved(tuple(chain_hashes(node, self.page_size)), medium))

    def stored_pages(self, hashes: list[bytes], medium: str) -> None:
        """Pages known by hash alone (a put tried again) are now on `medium`."""
        if self.enabled and hashes:
            self._events.append(BlockStored(tuple(hashes), None, len(hashes) * self.page_size, medium))

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
