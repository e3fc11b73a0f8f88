"""Build (docs/DESIGN.md, "speculative decoding"): the draft model, its device pool and where its state
lives, from `--speculative-*` and `--hicache-draft-layout`; then the proposer (the draft's, or the n-gram
one, which needs nothing built) and the decoder over the target's runner.

The draft's device pool has the target's page count and page size: it is indexed by the target's
logical pages, so allocation, the tree and every reservation stay the target's alone (the draft's
memory is extra, and smaller).

Where it runs (docs/DESIGN.md, "Speculative decoding on every topology"): all of it on every pipeline
stage, sharded over the stage's TP ranks like the target where its KV heads and MLP columns split (its
host rows then have the target's shape, so it can pack), whole on each TP rank where they do not; under
CP its pages are sharded like the target's (the same logical pages, the same owners). An MTP head under
PP reads the target's final hidden states, which the last stage sends back to the others
(hicache/spec/decoder.py), and under CP reads each row's predecessor from the rank that owns it (mtp.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hicache.cache import KVCache
from hicache.config import EngineConfig
from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_group import DraftPools
from hicache.mem.host_pool import PartShard
from hicache.model.build import build_decoder, with_attention_family
from hicache.model.config import LoadedModel
from hicache.model.families.registry import family_of
from hicache.model.loading.draft import load_draft
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.model_runner import ModelRunner
from hicache.spec.decoder import SpeculativeDecoder
from hicache.spec.draft_proposer import DraftProposer
from hicache.spec.draft_state import KVGeometry, choose_layout
from hicache.spec.ngram import NgramProposer
from hicache.spec.proposer import Proposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Draft:
    runner: ModelRunner
    pools: DraftPools  # what the cache keeps of it


def draft_context(pctx: ParallelContext, draft: LoadedModel) -> ParallelContext:
    """The ranks one copy of the draft runs on: this rank's stage (its TP group sharding it) where the
    draft's shapes split over TP and its KV would not be page-sharded, else this rank alone."""
    stage = pctx.stage_view()
    c, tp = draft.config, stage.tp_size
    splits = c.num_kv_heads % tp == 0 and c.intermediate_size % tp == 0
    return stage if splits and not family_of(draft).decoder.replicated_over_tp else ParallelContext()


def draft_shard(pctx: ParallelContext, context: ParallelContext, heads: range, num_kv_heads: int) -> PartShard:
    """This rank's copy of the draft within the whole: its KV heads, and whether another rank writes the
    same bytes. Every stage holds the whole draft (the first writes it), and a draft that does not split
    over TP is whole on each TP rank (the first writes it); CP ranks hold other pages, so none is a
    replica of another."""
    replica = pctx.pp_rank > 0 or (context.tp_size == 1 and pctx.tp_rank > 0)
    return PartShard(heads, num_kv_heads, replica)


def build_draft(cfg: EngineConfig, target: LoadedModel, target_pool: DeviceKVPool, pctx: ParallelContext) -> Draft:
    spec = cfg.speculative
    assert spec.speculative_draft_model is not None
    loaded = load_draft(spec.speculative_draft_model, target)
    if pctx.cp_size > 1 and not family_of(loaded).decoder.page_shardable:
        raise UserError(
            f"--speculative-draft-model {loaded.name} keeps per-token state beside its KV that --cp-size > 1 "
            "cannot shard yet (each token reads its predecessor's); use a draft without it, or --cp-size 1"
        )
    device, dtype = target_pool.device, target_pool.dtype
    context = draft_context(pctx, loaded)
    model = build_decoder(loaded, context, dtype, device, invariant=cfg.batch_invariant_ops)
    sharding = model.kv_sharding
    if sharding.size != target_pool.placement.shards:  # its pool is indexed by the target's pages: same owners
        raise UserError(
            f"--speculative-algorithm: the target's KV pages are sharded over {target_pool.placement.shards} "
            f"ranks and the draft's over {sharding.size}, and its pool is indexed by the target's pages (an MLA "
            "target at --tp-size > 1, or under CP a draft whose shapes do not split over TP, is not supported yet)"
        )
    if model.invariance is not None and not model.invariance.verified and cfg.batch_invariant_ops:
        # Outputs stay the target's either way (it verifies every token); only acceptance could vary.
        logger.warning("draft %s: batch-invariance self-check failed (%s)", loaded.name, model.invariance.detail)
    gathered = cfg.cp_gather_pages if sharding.size > 1 else None
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, cfg.num_pages, cfg.page_size, dtype, device,
                        sharding.size, sharding.rank, gathered)  # fmt: skip
    layout = choose_layout(cfg.hicache.hicache_draft_layout, KVGeometry.of(pool), KVGeometry.of(target_pool))
    logger.info(
        "speculative decoding: draft %s (%d layers, %s, %s), %d draft tokens per step",
        loaded.name, model.num_local_layers, pool.layout.describe(),
        f"sharded over TP{context.tp_size}" if context.tp_size > 1 else "whole on this rank",
        spec.speculative_num_draft_tokens,
    )  # fmt: skip
    identity = with_attention_family(loaded, device).identity  # its KV is attended as the target's is
    pools = DraftPools(pool, layout, identity, cfg.debug.debug_skip_draft_restore,
                       draft_shard(pctx, context, range(*model.kv_head_range), loaded.config.num_kv_heads))  # fmt: skip
    return Draft(ModelRunner(model, pool), pools)


def build_decoder_for(
    cfg: EngineConfig, target: ModelRunner, draft: Draft | None, cache: KVCache, context_length: int
) -> SpeculativeDecoder:
    """The decoder of `--speculative-algorithm`: over `draft`'s proposals (`build_draft`), or without one
    over the n-gram proposer's."""
    spec = cfg.speculative
    proposer: Proposer
    if draft is not None:
        # A draft catching up on a prompt takes at most a prefill chunk's worth of rows per step.
        proposer = DraftProposer(target, draft.runner, context_length, cfg.chunked_prefill_size)
    else:
        windows = spec.speculative_ngram_min_match_window_size, spec.speculative_ngram_max_match_window_size
        proposer = NgramProposer(*windows)
        logger.info("speculative decoding: n-gram proposals (match windows %d..%d), %d draft tokens per step",
                    *windows, spec.speculative_num_draft_tokens)  # fmt: skip
    return SpeculativeDecoder(target, proposer, cache, spec.speculative_num_draft_tokens, context_length)
