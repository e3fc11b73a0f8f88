"""Typed counters of the cache tiers (docs/DESIGN.md, "tiers": typed stats). Each tier owns one record and
counts into it; `KVCache.stats()` returns them together as a `CacheStats` snapshot, which the server
exports (hicache/server/metrics.py) and the tests read by field.

A part that does not exist is None (a device-only cache has no host, no storage, no workers), so what
is exported is exactly what the deployment has.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Sequence, TypeVar

from hicache.cache.retention import RetentionStats
from hicache.storage import StorageStats

T = TypeVar("T")


class PrefetchLoss(str, enum.Enum):
    """Why a page found in storage did not end up serving a request."""

    BELOW_THRESHOLD = "below_threshold"  # too few pages in storage to be worth a prefetch
    HOST_FULL = "host_full"  # no host memory for it, even after host eviction
    READ_FAILED = "read_failed"  # missing, corrupt or unreadable when read (storage metrics say which)
    NOT_READ_IN_TIME = "not_read_in_time"  # the policy stopped waiting before it was read
    ALREADY_CACHED = "already_cached"  # the tree got it from elsewhere meanwhile
    PREFIX_EVICTED = "prefix_evicted"  # the cached prefix it continues was evicted meanwhile
    CANCELLED = "cancelled"  # the request went away
    DRAFT_MISSING = "draft_missing"  # the target's page is stored, the speculative draft's is not


@dataclass
class HostStats:
    """Device <-> host copies (pages and bytes)."""

    backup_pages: int = 0
    backup_bytes: int = 0
    backup_skipped_host_full_pages: int = 0  # not backed up: no host memory even after host eviction
    host_copies_dropped_pages: int = 0  # host copies of device-resident prefixes freed to make room
    load_pages: int = 0
    load_bytes: int = 0
    load_failed_pages: int = 0  # loads that failed (on any rank): their requests recomputed
    load_timed_out_pages: int = 0  # loads not landed within --hicache-transfer-timeout: likewise
    load_failed_requests: int = 0  # requests sent back to recompute the prefix a failed load was to bring


@dataclass
class PrefetchStats:
    """Pages at each stage of the prefetch lifecycle (queried -> hit -> allocated -> read -> inserted),
    and every page lost on the way, by reason."""

    queried: int = 0
    hit: int = 0
    allocated: int = 0
    read: int = 0
    inserted: int = 0
    lost: dict[PrefetchLoss, int] = field(default_factory=lambda: dict.fromkeys(PrefetchLoss, 0))

    def lose(self, reason: PrefetchLoss, pages: int) -> None:
        self.lost[reason] += pages


@dataclass
class StorageTierStats:
    put_pages: int = 0  # pages queued for storage (content addressing may skip some)
    put_failed_pages: int = 0  # queued pages whose put found the store unavailable
    put_retried_pages: int = 0  # of those, put again when a request reused them and the store was back
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)
    store: StorageStats = field(default_factory=StorageStats)  # what the store itself saw


@dataclass
class WorkerStats:
    """The transfer workers together (backup, load and storage)."""

    transfer_worker_restarts: int = 0
    transfer_failures: int = 0


@dataclass
class CacheStats:
    host: HostStats | None = None
    storage: StorageTierStats | None = None
    workers: WorkerStats | None = None
    retention: RetentionStats | None = None  # None: nothing is cached (radix cache off)

    @staticmethod
    def worst(answers: Sequence[CacheStats]) -> CacheStats:
        """Every counter at its largest over ranks. Ranks apply the same cache operations, so tier
        counters agree; what can differ (storage faults, worker restarts) is then the worst rank's."""
        merged = copy.deepcopy(answers[0])
        for other in answers[1:]:
            merged = _max(merged, other)
        return merged


def _max(a: T, b: T) -> T:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, dict):
        return {k: _max(a.get(k), b.get(k)) for k in {**a, **b}}  # type: ignore[attr-defined,return-value]
    if dataclasses.is_dataclass(a):
        fields = {f.name: _max(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)}
        return dataclasses.replace(a, **fields)  # type: ignore[type-var]
    return max(a, b)  # type: ignore[type-var]
