"""The cache (docs/DESIGN.md, "cache API"): what the parts above it use, in one place. A scheduler
drives a `KVCache` through `KVHandle`s; `build_cache` puts one together from the configuration; the
capacity simulator builds its tiers (`device_cache`, `hierarchical_cache`) with virtual-time `Worker`s."""

from hicache.cache.api import (
    TIERS,
    Admission,
    KVCache,
    KVHandle,
    KVState,
    PrefixMatch,
    RestoreState,
    RestoreStatus,
)  # fmt: skip
from hicache.cache.build import (
    build_cache,
    check_unified,
    device_cache,
    hierarchical_cache,
    storage_identity,
    storage_layout,
)  # fmt: skip
from hicache.cache.controller import TransferOp, Worker
from hicache.cache.failed_loads import FailedLoads
from hicache.cache.host_tier import WritePolicy
from hicache.cache.kv_events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventRecorder
from hicache.cache.prefix_cache import PrefixCache
from hicache.cache.retention import MAX_PRIORITY, NO_RETENTION, Retention, RetentionStats
from hicache.cache.stats import CacheStats, HostStats, PrefetchLoss, StorageTierStats, WorkerStats
from hicache.cache.storage_tier import PrefetchPolicy

__all__ = [
    "MAX_PRIORITY",
    "MEDIA",
    "NO_RETENTION",
    "TIERS",
    "Admission",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "FailedLoads",
    "HostStats",
    "KVCache",
    "KVEvent",
    "KVEventRecorder",
    "KVHandle",
    "KVState",
    "PrefetchLoss",
    "PrefetchPolicy",
    "PrefixCache",
    "PrefixMatch",
    "RestoreState",
    "RestoreStatus",
    "Retention",
    "RetentionStats",
    "StorageTierStats",
    "TransferOp",
    "Worker",
    "WorkerStats",
    "WritePolicy",
    "build_cache",
    "check_unified",
    "device_cache",
    "hierarchical_cache",
    "storage_identity",
    "storage_layout",
]
