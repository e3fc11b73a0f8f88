"""Build (DESIGN.md, "runtime"): one rank's scheduler (model shard, device pool, cache tiers, consensus,
checker) from the configuration and a ParallelContext. The single-rank engine and every rank process
of a TP/PP deployment build it here, so both run the same code."""

from __future__ import annotations

from hicache.cache.hierarchical import HierarchicalCache
from hicache.cache.prefix_cache import PrefixCache
from hicache.config import EngineConfig
from hicache.debug.consensus_checker import ConsensusChecker
from hicache.disagg.roles import radix_enabled, role_scheduler
from hicache.dist.consensus import Consensus
from hicache.dist.parallel import ParallelContext
from hicache.engine.model_runner import ModelRunner
from hicache.engine.scheduler import Scheduler
from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.build import build_decoder
from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.invariance import InvarianceReport


def context_length(cfg: EngineConfig, model: ModelConfig) -> int:
    return min(cfg.context_length or model.max_position, model.max_position)


def check_topology(cfg: EngineConfig, model: ModelConfig) -> None:
    """The model must split evenly over the ranks asked for (checked before any rank starts)."""
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    for what, count in (("KV heads", model.num_kv_heads), ("MLP columns", model.intermediate_size)):
        if count % tp:
            raise UserError(f"--tp-size {tp} does not divide the model's {count} {what}")
    if model.num_layers < pp:
        raise UserError(f"--pp-size {pp} is more than the model's {model.num_layers} layers")


def check_invariance(cfg: EngineConfig, report: InvarianceReport) -> None:
    """A prefix cache is refused where the self-check failed: it could change answers there. Without
    one, every token is computed the same way in every run, so there is nothing to protect."""
    if report.verified or cfg.disable_radix_cache or not cfg.batch_invariant_ops:
        return
    raise UserError(
        f"batch-invariance self-check failed on this machine ({report.detail}); a prefix cache could change "
        "answers here, so it is refused: serve with --disable-radix-cache, or try --dtype float32/bfloat16"
    )


def build_scheduler(cfg: EngineConfig, loaded: LoadedModel, pctx: ParallelContext) -> Scheduler:
    device, dtype = cfg.resolved_device(), cfg.resolved_dtype()
    model = build_decoder(loaded, pctx, dtype, device, invariant=cfg.batch_invariant_ops)
    check_invariance(cfg, model.invariance)
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, cfg.num_pages, cfg.page_size, dtype, device)
    checker = ConsensusChecker(pctx)
    cache: PrefixCache
    if cfg.hicache.enable_hierarchical_cache:
        consensus = Consensus(pctx, pp_sync=not cfg.debug.debug_disable_pp_sync)
        checker.instrument(consensus)
        cache = HierarchicalCache(pool, cfg.hicache, consensus, loaded.identity, pctx.suffix, cfg.debug)
    else:
        cache = PrefixCache(pool, enabled=radix_enabled(cfg))
    for part in cache.checked_parts():
        checker.instrument(part)
    runner = ModelRunner(model, pool)
    # The P/D role (hicache/disagg/roles.py) picks the scheduler; without one it is the plain Scheduler.
    scheduler = role_scheduler(
        cfg, runner, pctx, loaded.identity, cache, loaded.tokenizer, context_length(cfg, loaded.config), checker
    )
    checker.instrument(scheduler)
    return scheduler
