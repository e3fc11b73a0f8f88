"""Which pages an instance holds, per tier, as its KV events say (docs/DESIGN.md, "KV events").

The publisher keeps one to answer snapshot requests; a subscriber (the router) keeps one per
instance, and matches a prompt against it without asking the server: the prompt's chained page hashes
(`prompt_hashes`, the same chain the server computes, seeded by the request's cache_salt), then the
leading run of them on each tier. A set per tier is enough: a tree holds a prefix once per namespace,
so a page hash names one page.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.cache import MEDIA, AllBlocksCleared, BlockStored, KVEvent
from hicache.storage import page_hashes, salt_seed


def prompt_hashes(tokens: Sequence[int], page_size: int, cache_salt: str = "") -> list[bytes]:
    """The page hashes a server's events name the full pages of `tokens` by."""
    return page_hashes(tokens, page_size, salt_seed(cache_salt))


class BlockIndex:
    def __init__(self) -> None:
        self.pages: dict[str, set[bytes]] = {medium: set() for medium in MEDIA}

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            for medium in event.media:
                self.pages[medium].clear()
        elif isinstance(event, BlockStored):
            self.pages[event.medium].update(event.block_hashes)
        else:
            self.pages[event.medium].difference_update(event.block_hashes)

    def counts(self) -> dict[str, int]:
        """Pages held per tier."""
        return {medium: len(pages) for medium, pages in self.pages.items()}

    def blocks(self) -> dict[str, list[bytes]]:
        return {medium: sorted(pages) for medium, pages in self.pages.items()}

    @classmethod
    def of(cls, blocks: dict[str, list[bytes]]) -> BlockIndex:
        index = cls()
        for medium, hashes in blocks.items():
            index.pages[medium] = set(hashes)
        return index

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per tier, how many leading pages of `hashes` (a prompt's, `prompt_hashes`) it holds."""
        out = {}
        for medium, pages in self.pages.items():
            n = 0
            while n < len(hashes) and hashes[n] in pages:
                n += 1
            out[medium] = n
        return out

    def prefix_tiers(self, hashes: Sequence[bytes]) -> list[str]:
        """The fastest tier (MEDIA order) holding each leading page of `hashes` that some tier holds: how
        the server's own match reads a prompt's prefix, device pages first, then host, then storage."""
        tiers = []
        for page in hashes:
            tier = next((medium for medium in MEDIA if page in self.pages[medium]), None)
            if tier is None:
                break
            tiers.append(tier)
        return tiers
