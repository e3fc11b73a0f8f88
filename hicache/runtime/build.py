"""Build (docs/DESIGN.md, "runtime"): one rank's scheduler (model shard, device pool, cache tiers, consensus,
checker) from the configuration and a ParallelContext. The single-rank engine and every rank process
of a TP/PP deployment build it here, so both run the same code."""

from __future__ import annotations

import hashlib
import logging

import torch

from hicache.cache.hierarchical import HierarchicalCache
from hicache.cache.prefix_cache import PrefixCache
from hicache.cache.stores import UnifiedPlacement, unified_namespace
from hicache.config import EngineConfig
from hicache.debug.consensus_checker import ConsensusChecker
from hicache.disagg.roles import pd_role, radix_enabled
from hicache.engine.model_runner import ModelRunner
from hicache.engine.scheduler import Scheduler
from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.build import build_decoder, resolve_quantization, with_weight_format
from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.families.mla import MLAConfig
from hicache.model.kernels.invariance import InvarianceReport
from hicache.model.loading.loader import load_model
from hicache.parallel.consensus import Consensus
from hicache.parallel.parallel import ParallelContext
from hicache.parallel.placement import storage_shard
from hicache.spec.build import build_decoder_for, build_draft
from hicache.storage.unified import KVGeometry, Shard, check_aligned, shard_of

logger = logging.getLogger(__name__)


def context_length(cfg: EngineConfig, model: ModelConfig) -> int:
    return min(cfg.context_length or model.max_position, model.max_position)


def check_topology(cfg: EngineConfig, model: ModelConfig) -> None:
    """The model must split evenly over the ranks asked for (checked before any rank starts)."""
    tp, pp, cp = cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.parallel.cp_size
    if cp > 1 and pp > 1:
        raise UserError("--cp-size with --pp-size > 1 is not supported yet")
    if cp > 1 and cfg.num_pages < 2:
        raise UserError("--cp-size needs a device pool of at least two pages per rank (a padding page and one)")
    for what, count in (("KV heads", model.num_kv_heads), ("MLP columns", model.intermediate_size)):
        if count % tp:
            raise UserError(f"--tp-size {tp} does not divide the model's {count} {what}")
    if model.num_layers < pp:
        raise UserError(f"--pp-size {pp} is more than the model's {model.num_layers} layers")
    if cfg.hicache.hicache_storage_key_scheme == "unified" and cfg.hicache.hicache_storage_backend:
        check_unified(cfg, model)


def storage_geometry(model: ModelConfig, row_numel: int | None = None) -> KVGeometry:
    """The model's KV for the unified layout: K/V heads, or MLA's one latent row (row_numel)."""
    if isinstance(model, MLAConfig):
        return KVGeometry(model.num_layers, model.num_kv_heads, row_numel or model.kv_lora_rank + model.qk_rope_head_dim,
                          latent=True)  # fmt: skip
    return KVGeometry(model.num_layers, model.num_kv_heads, model.head_dim)


def check_unified(cfg: EngineConfig, model: ModelConfig) -> None:
    """Every rank of this topology must own whole cells of the grid (refused here, naming the boundary,
    before any rank starts). A speculative draft runs on one rank: its part has a grid of its own
    (hicache/cache/stores.py, unified_part_store), which it always owns whole."""
    cache = cfg.hicache
    grid = unified_namespace(cache, storage_geometry(model), "check", "check", cfg.page_size).grid
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    for p in range(pp):
        for t in range(tp):
            check_aligned(grid, shard_of(grid.geometry, tp, t, pp, p), f"rank tp{t}/pp{p} of --tp-size {tp} --pp-size {pp}")


def storage_layout(cfg: EngineConfig, model: ModelConfig, identity: str) -> dict:
    """What GET /hicache/storage_layout answers: the key scheme and, for the unified layout, the
    namespace (digest and every field it covers), the grid and how to form a key, so that an external
    router computes the object names of any prompt without asking a rank."""
    cache = cfg.hicache
    out: dict = {"key_scheme": cache.hicache_storage_key_scheme, "storage_backend": cache.hicache_storage_backend}
    if cache.hicache_storage_key_scheme != "unified" or not cache.hicache_storage_backend:
        return {**out, "namespace_digest": None}
    dtype = str(cfg.resolved_dtype()).removeprefix("torch.")
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


def check_invariance(cfg: EngineConfig, report: InvarianceReport) -> None:
    """A prefix cache is refused where the self-check failed: it could change answers there. Without
    one, every token is computed the same way in every run, so there is nothing to protect."""
    if report.verified or cfg.disable_radix_cache or not cfg.batch_invariant_ops:
        return
    raise UserError(
        f"batch-invariance self-check failed on this machine ({report.detail}); a prefix cache could change "
        "answers here, so it is refused: serve with --disable-radix-cache, or try --dtype float32/bfloat16"
    )


def storage_identity(identity: str, report: InvarianceReport | None) -> str:
    """The model identity stored pages are namespaced by. Every topology reads every other's pages only
    where they compute the same bits: where this rank's kernels round otherwise at one thread than at
    its count (the self-check's one-thread probe), its pages carry the count, so a server of another
    TP size or thread count finds them a miss instead of other bits."""
    if report is None or report.thread_count_invariant:
        return identity
    return hashlib.sha256(f"{identity}:threads-{torch.get_num_threads()}".encode()).hexdigest()


def load_engine_model(cfg: EngineConfig) -> LoadedModel:
    """The model `cfg` names, to be built in the weight format its `--quantization` resolves to here."""
    loaded = load_model(cfg.model, keep_codes=cfg.quantization != "none")
    resolved = resolve_quantization(cfg.quantization, loaded, cfg.resolved_dtype(), cfg.resolved_device())
    logger.info("weights of %s: quantization %s -> %s", loaded.name, cfg.quantization, resolved)
    return with_weight_format(loaded, resolved)


def build_scheduler(cfg: EngineConfig, loaded: LoadedModel, pctx: ParallelContext) -> Scheduler:
    device, dtype = cfg.resolved_device(), cfg.resolved_dtype()
    model = build_decoder(loaded, pctx, dtype, device, invariant=cfg.batch_invariant_ops)
    check_invariance(cfg, model.invariance)
    sharding = model.kv_sharding  # each rank's pool holds its own pages of the logical pool
    gathered = cfg.cp_gather_pages if sharding.size > 1 else None
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, cfg.num_pages, cfg.page_size, dtype, device,
                        sharding.size, sharding.rank, gathered)  # fmt: skip
    draft = build_draft(cfg, loaded, pool) if cfg.speculative.enabled else None
    checker = ConsensusChecker(pctx)
    cache: PrefixCache
    if cfg.hicache.enable_hierarchical_cache:
        consensus = Consensus(pctx, pp_sync=not cfg.debug.debug_disable_pp_sync)
        checker.instrument(consensus)
        shard = storage_shard(pctx, sharding, model.replicated_over_tp)
        unified = None
        if cfg.hicache.hicache_storage_key_scheme == "unified":
            geometry = storage_geometry(loaded.config, model.kv_layout.row_numel)
            heads = range(geometry.num_kv_heads) if geometry.latent else range(*model.kv_head_range)
            unified = UnifiedPlacement(geometry, Shard(range(*model.layer_range), heads))
        cache = HierarchicalCache(
            pool, cfg.hicache, consensus, storage_identity(loaded.identity, model.invariance), shard.suffix, cfg.debug,
            draft.pools if draft else None, storage_writer=shard.writes, unified=unified,
        )
    else:
        cache = PrefixCache(pool, enabled=radix_enabled(cfg), draft=draft is not None)
    for part in cache.checked_parts():
        checker.instrument(part)
    runner, context = ModelRunner(model, pool), context_length(cfg, loaded.config)
    compute = build_decoder_for(cfg, runner, draft, cache, context) if draft is not None else None
    # The scheduler's parts: how a step is computed (plain or speculative) and its P/D role, if any.
    role = pd_role(cfg, runner, pctx, loaded.identity)
    scheduler = Scheduler(cfg, runner, cache, loaded.tokenizer, context, checker, compute, role)
    checker.instrument(scheduler)
    if role is not None:
        checker.instrument(role)  # the checker wraps only the marked methods of the object it is given
    return scheduler
