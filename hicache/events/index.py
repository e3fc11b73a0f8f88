"""Which pages a server holds, per tier, as its KV events say (docs/DESIGN.md, "KV events").

A subscriber (the router) keeps one per server and matches a prompt against it without asking the
server. Servers name pages by hashes of their own (a vLLM server's are seeded at random at its start),
so the index also names each page by content: hicache's chain (`prompt_hashes`: SHA-256 down the pages'
token ids, seeded by the request's cache_salt), computed from the event's token ids and its parent's
chain hash. A prompt's chain then finds the leading run of its pages each tier holds, on any server
speaking vLLM's format. A page whose parent the index never saw (it joined after the parent was
dropped everywhere) keeps its server hash only: it cannot be the start of a prompt's run anyway.

The publisher keeps one too (`keep_tokens`), to answer a replay that reaches further back than its
buffer with the state itself: every held page, parents first (`state_events`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.cache import MEDIA
from hicache.events.wire import MEDIUM_OF, AllBlocksCleared, BlockHash, BlockStored, WireEvent, salt_of, tier_of
from hicache.storage import page_hashes, salt_seed


def prompt_hashes(tokens: Sequence[int], page_size: int, cache_salt: str = "") -> list[bytes]:
    """The content chain (`BlockIndex.prefix_tiers`) of the full pages of `tokens`."""
    return page_hashes(tokens, page_size, salt_seed(cache_salt))


@dataclass
class _Block:
    parent: BlockHash | None
    chain: bytes | None  # its content hash (prompt_hashes' chain); None: its parent's is not known
    tokens: array | None  # kept for the publisher's state only (4 bytes a token)
    salt: str


class BlockIndex:
    def __init__(self, keep_tokens: bool = False) -> None:
        self.keep_tokens = keep_tokens
        self.block_size: int | None = None  # of the last page stored (a server has one)
        self._clear()

    def _clear(self) -> None:
        self.pages: dict[str, set[BlockHash]] = {tier: set() for tier in MEDIA}  # the server's hashes
        self._blocks: dict[BlockHash, _Block] = {}  # every page held on some tier
        self._by_chain: dict[bytes, BlockHash] = {}

    def apply(self, event: WireEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self._clear()
        elif isinstance(event, BlockStored):
            self._stored(event)
        else:
            held = self.pages[tier_of(event.medium)]
            for block in event.block_hashes:
                held.discard(block)
                self._forget_if_unheld(block)

    def _stored(self, event: BlockStored) -> None:
        size, held = event.block_size, self.pages[tier_of(event.medium)]
        self.block_size = size
        parent = event.parent_block_hash
        prior = salt_seed(salt_of(event)) if parent is None else self._chain_of(parent)
        for i, block in enumerate(event.block_hashes):
            tokens = event.token_ids[i * size : (i + 1) * size]
            if block not in self._blocks:
                # No chain without its parent's, nor from a page sent without its tokens (some publishers
                # leave them out): it is held, but never matched.
                chain = None if prior is None or len(tokens) < size else page_hashes(tokens, size, prior)[0]
                kept = array("I", tokens) if self.keep_tokens else None
                self._blocks[block] = _Block(parent, chain, kept, salt_of(event) if parent is None else "")
                if chain is not None:
                    self._by_chain[chain] = block
            held.add(block)
            prior, parent = self._blocks[block].chain, block

    def _chain_of(self, block: BlockHash) -> bytes | None:
        known = self._blocks.get(block)
        return None if known is None else known.chain

    def _forget_if_unheld(self, block: BlockHash) -> None:
        if any(block in held for held in self.pages.values()):
            return
        known = self._blocks.pop(block, None)
        if known is not None and known.chain is not None and self._by_chain.get(known.chain) == block:
            del self._by_chain[known.chain]

    def counts(self) -> dict[str, int]:
        """Pages held per tier."""
        return {tier: len(pages) for tier, pages in self.pages.items()}

    def chain_hashes(self) -> dict[str, set[bytes]]:
        """The content hashes of the pages held per tier (those whose chain is known)."""
        return {
            tier: {c for b in held if (c := self._blocks[b].chain) is not None} for tier, held in self.pages.items()
        }

    def match(self, chain: Sequence[bytes]) -> dict[str, int]:
        """Per tier, how many leading pages of `chain` (a prompt's, `prompt_hashes`) it holds."""
        blocks = self._blocks_of(chain)
        out = {}
        for tier, held in self.pages.items():
            n = 0
            while n < len(blocks) and blocks[n] in held:
                n += 1
            out[tier] = n
        return out

    def prefix_tiers(self, chain: Sequence[bytes]) -> list[str]:
        """The fastest tier (MEDIA order) holding each leading page of `chain` that some tier holds: how
        the server's own match reads a prompt's prefix, device pages first, then host, then storage."""
        tiers = []
        for block in self._blocks_of(chain):
            tier = next((tier for tier in MEDIA if block in self.pages[tier]), None)
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    def _blocks_of(self, chain: Sequence[bytes]) -> list[BlockHash]:
        """The server's hashes of the leading pages of `chain` it has named."""
        blocks = []
        for page in chain:
            block = self._by_chain.get(page)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def state_events(self) -> list[WireEvent]:
        """What a subscriber that knows nothing applies to hold what this index holds (keep_tokens):
        AllBlocksCleared, then the held pages as BlockStored, each after its parent, in runs that chain."""
        events: list[WireEvent] = [AllBlocksCleared()]
        runs: dict[str, BlockStored] = {}  # the open run per tier
        for block in self._parents_first():
            known = self._blocks[block]
            for tier, held in self.pages.items():
                if block not in held:
                    continue
                run = runs.get(tier)
                if run is not None and run.block_hashes[-1] == known.parent:
                    run.block_hashes.append(block)
                    run.token_ids += known.tokens or []
                    continue
                salt = [(known.salt,)] if known.salt else None
                runs[tier] = BlockStored(
                    [block],
                    known.parent,
                    list(known.tokens or []),
                    self.block_size or 0,
                    None,
                    MEDIUM_OF[tier],
                    None,
                    salt,
                )
                events.append(runs[tier])  # in the order runs open: each run's parent is in an earlier one
        for run in events[1:]:
            if run.extra_keys:  # one entry per block, as vLLM's
                run.extra_keys += [None] * (len(run.block_hashes) - 1)
        return events

    def _parents_first(self) -> list[BlockHash]:
        """Every held page, each after the held pages above it (iterative: a chain may be 10^4 pages)."""
        order: list[BlockHash] = []
        placed: set[BlockHash] = set()
        for block in self._blocks:
            climb = []
            while block is not None and block in self._blocks and block not in placed:
                climb.append(block)
                placed.add(block)
                block = self._blocks[block].parent
            order += reversed(climb)
        return order
