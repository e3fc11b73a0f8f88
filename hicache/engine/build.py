"""Build (docs/DESIGN.md, "engine"): one rank's scheduler (model shard, device pool, cache tiers, consensus,
checker) from the configuration and a ParallelContext. The single-rank engine and every rank process
of a TP/PP deployment build it here, so both run the same code."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import torch

from hicache.cache import build_cache, check_unified
from hicache.config import EngineConfig
from hicache.debug.consensus_checker import ConsensusChecker
from hicache.disagg.roles import pd_role, radix_enabled
from hicache.errors import UserError
from hicache.events import KVEventPublisher
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.build import (
    build_decoder,
    kernel_available,
    resolve_quantization,
    weight_formats,
    with_attention_family,
    with_weight_format,
)
from hicache.model.config import LoadedModel, ModelConfig
from hicache.model.families import hybrid
from hicache.model.families.mla import MLAConfig
from hicache.model.kernels.invariance import InvarianceReport
from hicache.model.loading.loader import load_model
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.model_runner import ModelRunner, StepCompute, StepOutput, WorkItem
from hicache.scheduler.scheduler import Scheduler
from hicache.spec.build import build_decoder_for, build_draft

logger = logging.getLogger(__name__)


def context_length(cfg: EngineConfig, model: ModelConfig) -> int:
    """--context-length, or the model's default. Asking past what the model allows (ModelConfig.context_limit)
    is refused rather than clamped: a server quietly shorter than asked would fail requests its caller sized."""
    limit = model.context_limit or model.max_position
    if cfg.context_length is not None and cfg.context_length > limit:
        raise UserError(f"--context-length {cfg.context_length} is more than the model's {limit} positions")
    return cfg.context_length or model.max_position


def check_topology(cfg: EngineConfig, model: ModelConfig) -> None:
    """The model must split evenly over the ranks asked for (checked before any rank starts)."""
    tp, pp, cp = cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.parallel.cp_size
    if cp > 1 and cfg.num_pages < 2:
        raise UserError("--cp-size needs a device pool of at least two pages per rank (a padding page and one)")
    for what, count in (("KV heads", model.num_kv_heads), ("MLP columns", model.intermediate_size)):
        if count % tp:
            raise UserError(f"--tp-size {tp} does not divide the model's {count} {what}")
    if model.num_layers < pp:
        raise UserError(f"--pp-size {pp} is more than the model's {model.num_layers} layers")
    if cfg.hicache.hicache_storage_key_scheme == "unified" and cfg.hicache.hicache_storage_backend:
        check_unified(cfg, model)


def check_hybrid(cfg: EngineConfig, loaded: LoadedModel) -> None:
    """A hybrid model (hicache/model/families/hybrid.py) is served where its recurrent state and sliding-window
    KV are tested to keep the cache invariant: one rank, the device, host and storage tiers, a P/D pair
    (docs/DESIGN.md, "hybrid models"). Elsewhere it is refused before any rank starts, naming what is not built."""
    if loaded.family != hybrid.FAMILY:
        if cfg.swa_full_tokens_ratio != 1:
            raise UserError(f"--swa-full-tokens-ratio sizes a sliding-window pool: model {loaded.name} has none")
        if cfg.mamba_track_interval is not None:
            raise UserError(f"--mamba-track-interval places recurrent-state snapshots: model {loaded.name} has none")
        return
    missing = [what for what, asked in (
        ("--tp-size > 1", cfg.parallel.tp_size > 1), ("--pp-size > 1", cfg.parallel.pp_size > 1),
        ("--cp-size > 1", cfg.parallel.cp_size > 1), ("--speculative-algorithm", cfg.speculative.enabled),
        ("--hicache-storage-key-scheme unified", cfg.hicache.hicache_storage_key_scheme == "unified"),
    ) if asked]  # fmt: skip
    if missing:
        raise UserError(
            f"model {loaded.name} is a hybrid (sliding-window and recurrent layers); its state is not kept with "
            f"{', '.join(missing)} yet: serve it on one rank (the device, host and storage tiers and P/D run)"
        )
    if cfg.mamba_track_interval is not None and not hybrid.has_recurrent_layers(loaded.config):
        raise UserError(f"--mamba-track-interval places recurrent-state snapshots: model {loaded.name} has no "
                        "recurrent layer")  # fmt: skip
    rows = hybrid.SNAPSHOT_ROWS
    if cfg.page_size < rows:
        raise UserError(
            f"model {loaded.name} stores a recurrent-state snapshot over {rows} rows of a page: "
            f"--page-size must be at least {rows}, got {cfg.page_size}"
        )


def check_invariance(cfg: EngineConfig, report: InvarianceReport) -> None:
    """A prefix cache is refused where the self-check failed: it could change answers there. Without
    one, every token is computed the same way in every run, so there is nothing to protect."""
    if report.verified or cfg.disable_radix_cache or not cfg.batch_invariant_ops:
        return
    raise UserError(
        f"batch-invariance self-check failed on this machine ({report.detail}); a prefix cache could change "
        "answers here, so it is refused: serve with --disable-radix-cache, or try --dtype float32/bfloat16"
    )


def check_kv_dtype(cfg: EngineConfig, loaded: LoadedModel) -> None:
    """A KV pool of another dtype than the activations (--kv-cache-dtype bfloat16 under float32) holds
    plain attention K/V: an MLA latent, a hybrid's recurrent state beside its KV, a draft's rows and a CP
    gather are read by code that expects the activations' dtype, so they are refused here, before any rank
    builds."""
    kv, activations = cfg.resolved_kv_dtype(), cfg.resolved_dtype()
    if kv == activations:
        return
    if kv != torch.bfloat16 or activations != torch.float32:
        raise UserError(f"--kv-cache-dtype {cfg.kv_cache_dtype} under {cfg.dtype} activations: a KV cache "
                        "of another dtype than the activations is bfloat16 under float32 only")  # fmt: skip
    others = {
        "an MLA latent": isinstance(loaded.config, MLAConfig),
        "a hybrid's recurrent state": isinstance(loaded.config, hybrid.HybridConfig),
        "a speculative draft": cfg.speculative.has_draft_model,
        "--cp-size > 1": cfg.parallel.cp_size > 1,
    }
    refused = [what for what, present in others.items() if present]
    if refused:
        raise UserError(f"--kv-cache-dtype bfloat16 under float32 activations keeps plain attention K/V only, "
                        f"not {' or '.join(refused)} ({loaded.name}); use --kv-cache-dtype auto")  # fmt: skip


def load_engine_model(cfg: EngineConfig) -> tuple[EngineConfig, LoadedModel]:
    """The model `cfg` names, to be built in the weight format its `--quantization` resolves to here, its
    identity naming that format and the attention kernels it runs on here; and `cfg` with `--dtype auto`
    resolved for that format (`activation_dtype`), which everything built from it reads."""
    loaded = load_model(cfg.model, keep_codes=cfg.quantization != "none")
    device = cfg.resolved_device()
    dtype = activation_dtype(cfg, loaded)
    cfg = replace(cfg, dtype=str(dtype).removeprefix("torch."))
    cfg = replace(cfg, kv_cache_dtype=str(cfg.resolved_kv_dtype()).removeprefix("torch."))  # `auto` resolved too
    check_kv_dtype(cfg, loaded)
    resolved = resolve_quantization(cfg.quantization, loaded, dtype, device)
    logger.info(
        "weights of %s: quantization %s -> %s, %s activations", loaded.name, cfg.quantization, resolved, cfg.dtype
    )
    return cfg, with_attention_family(with_weight_format(loaded, resolved, device), device)


def activation_dtype(cfg: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """`--dtype`, where `auto` means the fastest exact path for this checkpoint here (docs/DESIGN.md, "the
    fastest path by default"): on a CPU, float32 wherever the linear weights run on hicache's native
    quantized kernels (they quantize activations to 16-bit codes whatever the dtype, and the rest of the
    model runs its measured-fastest kernels in float32: on an AVX512-BF16 EPYC, bf16 activations took
    the short turn's TTFT 169 -> 225 ms and decode with tiers 39.9 -> 36.0 tok/s); bfloat16 for dense
    weights where the CPU multiplies it natively (3.4x float32's GEMM rate there), else float32. bfloat16
    on CUDA."""
    if cfg.dtype != "auto" or cfg.resolved_device().type != "cpu":
        return cfg.resolved_dtype()
    formats = weight_formats(cfg.quantization, loaded)
    if formats and all(kernel_available(f, torch.float32, cfg.resolved_device(), fast=True) for f in formats):
        return torch.float32
    return cfg.resolved_dtype()


class _SlowSteps:
    """--debug-step-delay-ms (fault injection): a `StepCompute` whose every step sleeps, then computes as
    `inner` does; it stands in for a model or prompt large enough that a request computes for longer
    than a peer's timeout (tests/disagg/test_engines.py)."""

    def __init__(self, inner: StepCompute, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.speculative = inner.speculative

    def step(self, work: list[WorkItem], before_layer: Callable[[int], None] | None) -> list[StepOutput]:
        time.sleep(self.delay_s)
        return self.inner.step(work, before_layer)


def build_scheduler(cfg: EngineConfig, loaded: LoadedModel, pctx: ParallelContext) -> Scheduler:
    device, dtype = cfg.resolved_device(), cfg.resolved_dtype()
    model = build_decoder(loaded, pctx, dtype, device, invariant=cfg.batch_invariant_ops)
    check_invariance(cfg, model.invariance)
    sharding = model.kv_sharding  # each rank's pool holds its own pages of the logical pool
    gathered = cfg.cp_gather_pages if sharding.size > 1 else None
    sliding = model.sliding_layers if isinstance(model, hybrid.HybridModel) else frozenset()
    window = model.cfg.sliding_window if isinstance(model, hybrid.HybridModel) else 0
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, cfg.num_pages, cfg.page_size, cfg.resolved_kv_dtype(),
                        device, sharding.size, sharding.rank, gathered, sliding, cfg.sliding_pages, window)  # fmt: skip
    draft = build_draft(cfg, loaded, pool, pctx) if cfg.speculative.has_draft_model else None
    checker = ConsensusChecker(pctx)
    pools = draft.pools if draft else None
    cache = build_cache(cfg, pool, model, loaded.identity, pctx, checker, radix_enabled(cfg), pools)
    runner, context = ModelRunner(model, pool), context_length(cfg, loaded.config)
    compute = build_decoder_for(cfg, runner, draft, cache, context) if cfg.speculative.enabled else None
    # The scheduler's parts: how a step is computed (plain or speculative) and its P/D role, if any.
    role = pd_role(cfg, runner, pctx, loaded.identity, pools)
    # Every rank of the tree-sharing group keeps the same tree: rank 0 publishes for them.
    kv_events = None
    if cfg.kv_events_endpoint and pctx.rank == 0:
        kv_events = KVEventPublisher(cfg.kv_events_endpoint, cache.events)
    steps = compute
    if cfg.debug.debug_step_delay_ms:
        steps = _SlowSteps(compute or runner, cfg.debug.debug_step_delay_ms / 1000)
    scheduler = Scheduler(cfg, runner, cache, loaded.tokenizer, context, checker, steps, role, kv_events)
    checker.instrument(scheduler)
    if compute is not None:
        checker.instrument(compute)  # speculative acceptance, the same on every rank
    if role is not None:
        checker.instrument(role)  # the checker wraps only the marked methods of the object it is given
    return scheduler
