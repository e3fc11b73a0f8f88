"""Building the cache (docs/DESIGN.md, "cache API"): the one place that reads the cache configuration
and puts the parts together: the device tier; with the hierarchical cache on, the host tier below it
and, with a backend, the storage tier below that; fault injection where a debug flag asks for it, so
no tier reads the debug configuration. Also the storage facts derived from the model that the runtime
checks before any rank starts (`check_unified`) and the server reports (`storage_layout`).
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from hicache.cache.controller import Clock, SupervisedWorker, WorkerFactory
from hicache.cache.device_tier import DeviceTier
from hicache.cache.host_tier import HostTier, WritePolicy, host_pool_pages
from hicache.cache.lower_tiers import LowerTiers
from hicache.cache.prefix_cache import PrefixCache
from hicache.cache.snapshot_policy import SnapshotPolicy
from hicache.cache.storage_tier import StorageTier
from hicache.cache.stores import UnifiedPlacement, open_store, unified_namespace
from hicache.config import DebugConfig, EngineConfig, HiCacheConfig
from hicache.debug.consensus_checker import ConsensusChecker
from hicache.debug.faults import FlakyReads, LoadFaults
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_group import DraftPools, make_host_pool
from hicache.model.base import DecoderModel
from hicache.model.config import ModelConfig
from hicache.model.families.hybrid import has_recurrent_layers
from hicache.model.families.mla import MLAConfig
from hicache.model.kernels.invariance import InvarianceReport
from hicache.parallel.consensus import Consensus
from hicache.parallel.parallel import ParallelContext
from hicache.parallel.placement import storage_shard
from hicache.storage import StorageBackend, open_backend
from hicache.storage.unified import KVGeometry, Shard, check_aligned, shard_of

logger = logging.getLogger(__name__)


def build_cache(
    cfg: EngineConfig,
    pool: DeviceKVPool,
    model: DecoderModel,
    identity: str,
    pctx: ParallelContext,
    checker: ConsensusChecker,
    radix: bool = True,
    draft: DraftPools | None = None,
) -> PrefixCache:
    """One rank's cache over `pool` for `model` (whose weights are named `identity`), its decisions
    recorded by `checker`. `radix`: False where the device tier alone matches and caches no prompt (the
    radix cache off, or a P/D decode server not asked to reuse prefixes); the hierarchical cache always
    keeps its tree. `draft`: a speculative draft sharing the device pages."""
    cache: PrefixCache
    snapshots = snapshot_policy(cfg, model.cfg)
    if cfg.hicache.enable_hierarchical_cache:
        consensus = Consensus(pctx, pp_sync=not cfg.debug.debug_disable_pp_sync)
        checker.instrument(consensus)
        shard = storage_shard(pctx, model.kv_sharding, model.replicated_over_tp)
        unified = None
        if cfg.hicache.hicache_storage_key_scheme == "unified":
            geometry = storage_geometry(model.cfg, model.kv_layout.row_numel)
            heads = range(geometry.num_kv_heads) if geometry.latent else range(*model.kv_head_range)
            unified = UnifiedPlacement(geometry, Shard(range(*model.layer_range), heads))
        cache = hierarchical_cache(
            pool, cfg.hicache, consensus, storage_identity(identity, model.invariance), shard.suffix, cfg.debug,
            draft, storage_writer=shard.writes, unified=unified, snapshots=snapshots,
        )  # fmt: skip
    else:
        cache = device_cache(pool, radix, draft=draft is not None, snapshots=snapshots)
    for part in cache.checked_parts():
        checker.instrument(part)
    return cache


def device_cache(
    pool: DeviceKVPool, radix: bool = True, draft: bool = False, snapshots: SnapshotPolicy | None = None
) -> PrefixCache:
    """The device tier alone (`radix` False: nothing is cached, so allocation never evicts)."""
    return PrefixCache(DeviceTier(pool, evict=radix), radix=radix, draft=draft, snapshots=snapshots)


def snapshot_policy(cfg: EngineConfig, model: ModelConfig) -> SnapshotPolicy | None:
    """Where a model with recurrent layers keeps their state (`--mamba-track-interval`; every page by
    default); None for a model without."""
    if not has_recurrent_layers(model):
        return None
    interval = cfg.page_size if cfg.mamba_track_interval is None else cfg.mamba_track_interval
    return SnapshotPolicy(interval // cfg.page_size)


def hierarchical_cache(
    pool: DeviceKVPool,
    cfg: HiCacheConfig,
    consensus: Consensus,
    model_identity: str,
    rank_suffix: str = "",
    debug: DebugConfig | None = None,
    draft: DraftPools | None = None,
    storage_writer: bool = True,  # this rank writes its pages to storage (not a replica of them)
    unified: UnifiedPlacement | None = None,  # --hicache-storage-key-scheme unified: the rank's shard
    make_worker: WorkerFactory = SupervisedWorker,
    clock: Clock = time.monotonic,
    snapshots: SnapshotPolicy | None = None,  # where a hybrid model's recurrent state is kept (its hits end)
) -> PrefixCache:
    """The device tier with the host tier below it and, when a backend is configured, the storage tier
    below that. `draft`: a speculative draft whose state the host and storage tiers keep with the
    target's. `make_worker`: where the tiers' copies and storage calls run (threads; the simulator's
    virtual links); `clock`: what the storage tier's prefetch timeout and put retries read the time from."""
    debug = debug or DebugConfig()
    rank = consensus.pctx.rank
    host_pool = make_host_pool(
        pool, host_pool_pages(pool, cfg, draft), cfg.hicache_mem_layout, draft, cfg.hicache_storage_head_partition or 1
    )
    device = DeviceTier(pool, on_host_free=host_pool.allocator.free)
    delay = debug.debug_transfer_delay_ms / 1000
    policy = WritePolicy(cfg.hicache_write_policy)
    host = HostTier(
        pool, host_pool, device.tree, device.budget, consensus, policy, cfg.hicache_load_back_threshold, delay,
        cfg.hicache_transfer_timeout, load_faults(debug, rank), make_worker,
    )  # fmt: skip
    storage = None
    if cfg.hicache_storage_backend:
        page_bytes = host_pool.parts[0].payload_bytes
        backend = storage_backend(cfg, debug, rank)
        store = open_store(cfg, pool, page_bytes, model_identity, rank_suffix, backend, unified, storage_writer)
        storage = StorageTier(store, host, consensus, cfg, delay, storage_writer, make_worker, clock)
    logger.info(
        "hierarchical cache: host %d pages (%.2f GB, %s), write policy %s, storage %s",
        host_pool.allocator.num_pages, host_pool.allocator.num_pages * host_pool.page_bytes / 1e9,
        cfg.hicache_mem_layout, policy.value, cfg.hicache_storage_backend or "none",
    )  # fmt: skip
    skip_draft_restore = draft is not None and draft.skip_restore
    lower = LowerTiers(host, storage, consensus)
    return PrefixCache(
        device, lower, draft=draft is not None, skip_draft_restore=skip_draft_restore, snapshots=snapshots
    )


# ---- fault injection (hicache/debug/faults.py), wired in here so the tiers never read debug flags ----


def load_faults(debug: DebugConfig, rank: int) -> LoadFaults | None:
    """--debug-load-fail-rate: seeded per rank, so ranks fail different loads."""
    return LoadFaults(debug.debug_load_fail_rate, seed=rank * 16 + 5) if debug.debug_load_fail_rate > 0 else None


def storage_backend(cfg: HiCacheConfig, debug: DebugConfig, rank: int) -> StorageBackend:
    """The configured backend; on the rank --debug-storage-fail-rank names, failing a fraction of reads."""
    backend = open_backend(cfg)
    if debug.debug_storage_fail_rate > 0 and rank == debug.debug_storage_fail_rank:
        backend = FlakyReads(backend, debug.debug_storage_fail_rate, seed=rank)
        rate = 100 * debug.debug_storage_fail_rate
        logger.warning("rank %d fails %.0f%% of storage reads (fault injection)", rank, rate)
    return backend


# ---- storage facts of the model ----------------------------------------------------------------


def storage_geometry(model: ModelConfig, row_numel: int | None = None) -> KVGeometry:
    """The model's KV for the unified layout: K/V heads, or MLA's one latent row (row_numel)."""
    if isinstance(model, MLAConfig):
        row = row_numel or model.kv_lora_rank + model.qk_rope_head_dim
        return KVGeometry(model.num_layers, model.num_kv_heads, row, latent=True)
    return KVGeometry(model.num_layers, model.num_kv_heads, model.head_dim)


def check_unified(cfg: EngineConfig, model: ModelConfig) -> None:
    """Every rank of this topology must own whole cells of the grid (refused here, naming the boundary,
    before any rank starts). A speculative draft's part has a grid of its own, over the whole draft's
    layers and KV heads (stores.py, unified_part_store), cut by heads only where the draft splits over TP
    as the target does."""
    cache = cfg.hicache
    grid = unified_namespace(cache, storage_geometry(model), "check", "check", cfg.page_size).grid
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    for p in range(pp):
        for t in range(tp):
            where = f"rank tp{t}/pp{p} of --tp-size {tp} --pp-size {pp}"
            check_aligned(grid, shard_of(grid.geometry, tp, t, pp, p), where)


def storage_layout(cfg: EngineConfig, model: ModelConfig, identity: str) -> dict:
    """What GET /hicache/storage_layout answers: the key scheme and, for the unified layout, the
    namespace (digest and every field it covers), the grid and how to form a key, so that an external
    router computes the object names of any prompt without asking a rank."""
    cache = cfg.hicache
    out: dict = {"key_scheme": cache.hicache_storage_key_scheme, "storage_backend": cache.hicache_storage_backend}
    if cache.hicache_storage_key_scheme != "unified" or not cache.hicache_storage_backend:
        return {**out, "namespace_digest": None}
    dtype = str(cfg.resolved_kv_dtype()).removeprefix("torch.")  # the pool's, as the stores name it
    ns = unified_namespace(cache, storage_geometry(model), identity, dtype, cfg.page_size)
    return {
        **out,
        "namespace_digest": ns.digest,
        "namespace": ns.describe(),
        "objects": [cell.suffix for cell in ns.grid.cells],
        "key_format": "{page_hash}_{namespace_digest}_{object}",
        "page_hash": "hex SHA-256 chain: digest_i = SHA-256(digest_{i-1} || page i's token ids as 4-byte "
        "little-endian), digest_{-1} = 32 zero bytes; full pages only",
    }


def storage_identity(identity: str, report: InvarianceReport | None) -> str:
    """The model identity stored pages are namespaced by. Every topology reads every other's pages only
    where they compute the same bits: where this rank's kernels round otherwise at one thread than at
    its count (the self-check's one-thread probe), its pages carry the count, so a server of another
    TP size or thread count finds them a miss instead of other bits."""
    if report is None or report.thread_count_invariant:
        return identity
    return hashlib.sha256(f"{identity}:threads-{torch.get_num_threads()}".encode()).hexdigest()
