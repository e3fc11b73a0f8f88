"""The cache API (docs/DESIGN.md, "cache API"): everything the scheduler sees of the KV cache.

The scheduler speaks to a `KVCache` and holds one `KVHandle` per request; it never touches the tree,
the pools or the tiers. Shaped after vLLM's `KVCacheManager` (the interface object) and
`KVCacheBlocks` / `req_to_blocks` (the per-request KV state the manager owns).

A handle's life:

    open (at arrival) ─▶ WAITING ─admit─▶ MATCHED ─▶ LOCKED ─▶ RESERVED ─▶ READY ─release─▶ RELEASED
                            ▲                           │ refused: the lock is dropped
                            └───────────────────────────┘

`admit` runs the middle steps in one call. `reserve` stops at RESERVED, for KV that another process
writes into the handle's pages (a prefill-decode decode server, hicache/disagg/: the suffix arrives from
prefill while the cache restores the host part); the caller then `complete`s it to READY once both
have landed, or `fail`s it (RELEASED) if either did not. In READY the scheduler asks for pages
(`extend`), records computed tokens (`KVHandle.advance`), rolls back rejected speculative tokens
(`KVHandle.truncate`), shares finished pages (`cache_prefix`), and at the end, finished or aborted,
`release`s the handle. `release` is valid in every state, so a request aborted while waiting is released the same way.

Locking: every call runs on the scheduler thread, between two steps. "Changes the tree" below means
nodes may be created, split, attached or evicted; a handle in READY holds exactly one tree lock, so the
prefix it uses can never be evicted under it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

import torch

from hicache.cache.page_keys import PackedTokens
from hicache.cache.retention import NO_RETENTION, Retention
from hicache.mem.page_table import PageTable

if TYPE_CHECKING:
    from hicache.cache.failed_loads import FailedLoads
    from hicache.cache.kv_events import KVEventRecorder
    from hicache.cache.radix import TreeNode
    from hicache.cache.stats import CacheStats

TIERS = ("device", "host", "storage")  # where a cached prompt token was served from


class KVState(str, enum.Enum):
    WAITING = "waiting"  # opened; holds nothing (a storage prefetch may be in flight)
    MATCHED = "matched"  # its cached prefix is known
    LOCKED = "locked"  # that prefix is locked in the tree
    RESERVED = "reserved"  # the pages it may still need are promised to it
    READY = "ready"  # its pages hold (or are being loaded with) the cached prefix; compute may run
    RELEASED = "released"  # everything given back; the handle is dead


_NEXT: dict[KVState, tuple[KVState, ...]] = {
    KVState.WAITING: (KVState.MATCHED, KVState.RESERVED, KVState.RELEASED),  # RESERVED: radix cache off
    KVState.MATCHED: (KVState.LOCKED,),
    KVState.LOCKED: (KVState.RESERVED, KVState.WAITING),  # WAITING: admission refused
    KVState.RESERVED: (KVState.READY, KVState.RELEASED),  # RELEASED: a P/D transfer or restore failed
    KVState.READY: (KVState.RELEASED,),
    KVState.RELEASED: (),
}


@dataclass(frozen=True)
class PrefixMatch:
    """Prompt tokens a request does not compute, by the tier that holds them (page multiples)."""

    device: int = 0
    host: int = 0  # loaded back from host memory
    storage: int = 0  # loaded back from host memory, where a storage prefetch had just put them

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "storage": self.storage}


class RestoreState(str, enum.Enum):
    RUNNING = "running"  # a host -> device restore its prefix needs is still copying
    LANDED = "landed"  # every page of its cached prefix holds its KV (also: nothing was restored)
    FAILED = "failed"  # a restore its prefix needs did not land: the handle can only `fail`


@dataclass(frozen=True)
class RestoreStatus:
    state: RestoreState
    error: str | None = None  # why it failed


@dataclass(frozen=True)
class Admission:
    admitted: bool
    cached: PrefixMatch = PrefixMatch()  # what the request will reuse (zero when refused)
    reserved_pages: int = 0  # pages promised to it beyond those it holds


@dataclass(eq=False)
class KVHandle:
    """One request's KV state, owned by the cache. The scheduler reads the fields; it changes them only
    through `advance`, `truncate` and the `KVCache` calls; only the cache that opened it writes the rest.
    """

    rid: int
    prompt: Sequence[int]  # the request's prompt ids (not copied)
    namespace: str
    page_size: int
    state: KVState = KVState.WAITING
    slot_device: torch.device = torch.device("cpu")  # where its slot table lives: the device pool's device
    # Its logical device pages, in order, and their slots (hicache/mem/page_table.py): the cache alone
    # changes it; a step reads the slots of its tokens as a view (`slots`).
    table: PageTable = field(init=False)
    kv_len: int = 0  # tokens whose KV is in `pages`
    reserved_pages: int = 0  # pages it may still allocate, promised at admission
    committed_len: int = 0  # tokens handed to the tree (shared with other requests)
    cached: PrefixMatch = PrefixMatch()
    lock: TreeNode | None = None  # the deepest node of its prefix, locked while READY
    # Speculative decoding (hicache/spec/): tokens whose draft-model state is in the draft pools, which
    # share `pages`; None when the cache serves no draft. Admission sets it to the prefix every pool
    # was restored with (the effective hit is their MIN); the draft computes the rest.
    draft_len: int | None = None
    # Owner class of its first page when pages are sharded over ranks (page P on (rotation + P) mod N):
    # its cached path's base, or where a new prefix starts (hicache/cache/page_budget.py). 0 unsharded.
    rotation: int = 0
    # False after a load of its host part failed (hicache/cache/failed_loads.py): admission then
    # recomputes that part instead of loading it again.
    load_host: bool = True
    # Prompt pages its storage prefetch put on the host, taken in at its first admission attempt and
    # kept, so an attempt refused for room does not make a retry count them as host hits.
    from_storage: range = range(0)
    # Its retention hint (retention.py): the nodes it matches and caches keep its priority for a while.
    retention: Retention = NO_RETENTION

    def __post_init__(self) -> None:
        self.table = PageTable(self.page_size, self.slot_device)

    @property
    def pages(self) -> list[int]:
        """Logical device pages holding its KV, in order (read-only: the cache changes them)."""
        return self.table.pages

    def slots(self, end: int) -> torch.Tensor:
        """The logical slots of tokens [0, end), a view of its page table (O(1), whatever its length).
        `end` may pass kv_len up to its pages' end (speculative rows). Raises ValueError beyond that."""
        return self.table.slots(end)

    @cached_property
    def packed_prompt(self) -> PackedTokens:
        """The prompt packed for the tree once (hicache/cache/page_keys.py; the prompt never changes):
        admission tries a waiting request again every step, and packing a 1M-token list costs ~15 ms
        where the match itself costs well under one."""
        return PackedTokens(self.prompt)

    # ---- scheduler side ------------------------------------------------------------------------

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        return self.cached.as_dict()

    def advance(self, end: int) -> None:
        """The KV of tokens [kv_len, end) was computed into its pages. Changes the tree: no.
        Raises ValueError if `end` moves back or beyond its pages."""
        if not self.kv_len <= end <= len(self.pages) * self.page_size:
            raise ValueError(f"advance to {end}: kv_len is {self.kv_len}, pages hold {len(self.pages)} pages")
        self.kv_len = end

    def truncate(self, kv_len: int) -> None:
        """Forget the KV of tokens [kv_len, self.kv_len) (rejected speculative tokens). The pages stay
        the request's (admission counted them) and are overwritten by the tokens that replace them.
        Changes the tree: no. Raises ValueError below what is shared with the tree (`committed_len`)
        or beyond `kv_len`."""
        if self.state is not KVState.READY:
            raise ValueError(f"truncate of a {self.state.value} handle")
        if not self.committed_len <= kv_len <= self.kv_len:
            raise ValueError(f"truncate to {kv_len}: must be in [{self.committed_len}, {self.kv_len}]")
        self.kv_len = kv_len
        if self.draft_len is not None:  # the draft's rejected proposals go with the target's
            self.draft_len = min(self.draft_len, kv_len)

    def advance_draft(self, end: int) -> None:
        """The draft's state of tokens [draft_len, end) was computed into its pools (speculative
        proposals may run ahead of kv_len until the verify step truncates). Raises ValueError for a
        handle without a draft, or `end` moving back or beyond its pages."""
        if self.draft_len is None or not self.draft_len <= end <= len(self.pages) * self.page_size:
            raise ValueError(f"advance_draft to {end}: draft_len is {self.draft_len}, pages hold {len(self.pages)}")
        self.draft_len = end

    @property
    def valid_len(self) -> int:
        """Tokens whose state every pool of the request holds (what may be shared through the tree)."""
        return self.kv_len if self.draft_len is None else min(self.kv_len, self.draft_len)

    # ---- cache side ----------------------------------------------------------------------------

    def enter(self, state: KVState) -> None:
        """Step to `state`; RuntimeError for a transition the life above does not have."""
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"request {self.rid}: KV handle cannot go from {self.state.value} to {state.value}")
        self.state = state


@runtime_checkable
class KVCache(Protocol):
    """What a scheduler needs from a KV cache. All calls run on the scheduler thread, and with several
    ranks every rank makes the same calls in the same order (the asynchronous results they take in
    are agreed across ranks inside the calls)."""

    page_size: int
    # What the tiers store and drop, page by page (kv_events.py): off until a publisher turns it on
    # and drains it once per step (hicache/events/).
    events: KVEventRecorder

    def open(self, rid: int, prompt: Sequence[int], namespace: str, retention: Retention = NO_RETENTION) -> KVHandle:
        """A request arrived: its handle, WAITING. `retention`: its hint, which every node it matches or
        caches takes (docs/DESIGN.md, "retention hints"). Changes the tree: no, not even the recency of its
        match (with a storage tier a prefetch of what storage holds beyond the tree's match, found as
        `lookup` finds it, may start in the background; what it reads joins the tree at admission).
        Locks: nothing."""

    def lookup(self, prompt: Sequence[int], namespace: str) -> PrefixMatch:
        """The cached prefix of `prompt` by tier, as admission would match it now, for arrival and
        routing (how much of a prompt this server holds): device tokens, then host tokens (the host-only
        continuation; admission loads it back only when that is worth it and fits); storage always 0,
        since asking the store is I/O (`open` starts that query). Page multiples, at most
        len(prompt) - 1 tokens: the last prompt token is always computed. Changes the tree: no (no
        split, recency or hit count). Locks: nothing, so eviction may take the prefix before admission."""

    def ready_to_admit(self, handle: KVHandle, busy: bool) -> bool:
        """False while the request waits for something (a storage prefetch). `busy`: other requests
        run, so waiting would not leave the engine idle. Changes the tree: no. Locks: nothing."""

    def admit(self, handle: KVHandle, total_pages: int) -> Admission:
        """WAITING → READY if the `total_pages` the request may ever need, less its cached prefix, fit in
        free + evictable pages minus what other handles were promised; else it stays WAITING, holding
        nothing. Changes the tree: yes (a finished prefetch is inserted, the match may split a node and
        counts a hit, a host continuation gets device pages, eviction may run). Locks: the matched
        prefix while deciding, then its deepest usable node, held until release. Raises RuntimeError
        for a handle that is not WAITING."""

    def reserve(self, handle: KVHandle, total_pages: int) -> Admission:
        """WAITING → RESERVED for a prompt whose KV beyond the cached prefix another process writes (the
        shape of vLLM's `allocate_slots(..., num_external_computed_tokens)`): the whole prompt is matched
        (nothing of it is computed here, so even its last token may come from the tree), the prefix
        locked, its host part restored in the background, the `total_pages` less that prefix promised,
        and the pages of the rest of the prompt taken now (`pages[kv_len:]`, for the KV to land in).
        Refused like `admit` (WAITING, holding nothing). `handle.kv_len` is then the prefix served from
        the tree. Changes the tree: yes, as `admit`. Raises RuntimeError for a handle not WAITING."""

    def restore_status(self, handle: KVHandle) -> RestoreStatus:
        """This rank's view of the restores a RESERVED handle's prefix needs: its own, and another
        request's still filling pages it shares. Ranks may see a restore land at different times: the
        caller agrees on the outcome before it completes or fails the handle. Changes the tree: no."""

    def complete(self, handle: KVHandle) -> None:
        """RESERVED → READY: the whole prompt's KV is in the handle's pages (agreed on every rank), shared
        through the tree now. With a speculative draft the outside KV carries the draft's rows too (P/D:
        docs/DESIGN.md, "Speculation x P/D"), so `draft_len` covers the prompt where the draft's prefix
        was restored. Changes the tree: yes. Raises RuntimeError unless its restores landed."""

    def fail(self, handle: KVHandle) -> None:
        """RESERVED (or WAITING) → RELEASED: the external KV or a restore did not land; everything goes
        back, the tree keeps its prefix. A restore that failed on any rank (agreed here) takes its device
        pages back once no handle needs them, so no later match reads pages never written; only the
        handles whose prefix needed it fail with it. Changes the tree: yes."""

    def extend(self, handle: KVHandle, end: int) -> None:
        """Give a READY handle pages for tokens [0, end), out of its reservation. Changes the tree: it
        may evict unlocked nodes (never the handle's locked prefix). Raises RuntimeError if that
        outgrows the reservation."""

    def cache_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        """Share the full pages of `tokens` (the request's sequence, computed up to len(tokens)) through
        the tree; where the tree had them first, its pages replace the handle's. Changes the tree: yes.
        Locks: moves the handle's lock to the last of those pages' nodes (the new one first)."""

    def release(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        """The request ended (finished or aborted), in any state: cache what it computed (`tokens`: its
        sequence, at least kv_len long), drop its lock, free the rest, return what it was promised,
        cancel a prefetch still running for it; RELEASED. Changes the tree: yes. Raises ValueError
        for fewer tokens than it computed, RuntimeError for a handle already released."""

    def check(self) -> None:
        """Take in completed asynchronous transfers (once per scheduler step, on every rank, even with
        nothing in flight: it is an agreement across ranks). Changes the tree: yes (backed-up nodes
        unlock and gain their host copy; failed ones lose it)."""

    def before_layer(self) -> Callable[[int], None] | None:
        """A hook for the forward pass: wait (bounded) for layer i of the loads in flight (None: nothing
        loads). A load that fails or times out does not fail the step (failed_loads.py)."""

    def failed_loads(self) -> FailedLoads:
        """After a step: the loads issued since the last call that did not land on every rank (agreed).
        The requests holding their pages go back to waiting; then `drop_failed_loads`."""

    def drop_failed_loads(self, failed: FailedLoads, requests: int) -> None:
        """Take back the device pages of `failed` (their nodes stay host-only), once the `requests` that
        held them were released. Changes the tree: yes."""

    def flush(self) -> None:
        """Drop every cached prefix on every in-memory tier (storage keeps its objects). Changes the
        tree: it empties it. Call only with no open READY handle."""

    def leak_report(self) -> list[str]:
        """What a flush should have left none of: pages out of their pools, locked nodes, promises,
        prefetches."""

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, capacity) in tokens per tier that exists."""

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of cached or in-use KV this rank holds per in-memory tier (its own pages when sharded)."""

    def stats(self) -> CacheStats:
        """A snapshot of the tiers' counters (transfers, prefetch lifecycle, storage results)."""

    def checked_parts(self) -> list[object]:
        """The objects whose consensus-checked decisions the rank consensus checker records."""

    def shutdown(self) -> None:
        """Finish the copies in flight and stop background work."""
