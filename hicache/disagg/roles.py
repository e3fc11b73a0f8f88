"""P/D disaggregation: roles (`--disaggregation-mode null|prefill|decode`), what each one runs.

`null` is one server doing everything (the `Scheduler` with no role part). `prefill` and `decode` give
the scheduler their role's part (`PrefillRole`, `DecodeRole`; hicache/scheduler/role.py says where the
scheduler calls it) over a transfer backend of this rank, and are refused where the batch-invariance
self-check failed: moving KV computed in one batch shape to be extended in another is exactly what
invariance protects. A decode server keeps a radix tree only with `--disaggregation-decode-enable-radix-cache`.
The role's description (`info`) is what `/disagg/info` shows and `hicache router` checks at start-up.
With speculative decoding both servers run the same draft, and a transfer moves its state with the
target's (docs/DESIGN.md, "Speculation x P/D"); under CP each rank sends the draft's rows of the pages
it owns, as the target's (cells.py). KV pages sharded over TP (MLA) with a draft are refused: the draft's
pages are not sharded that way.
"""

from __future__ import annotations

from typing import Any

from hicache.config import EngineConfig
from hicache.disagg.decode_role import DecodeRole
from hicache.disagg.handshake import Handshake, SpeculativeDraft
from hicache.disagg.kv_rows import chunk_tokens
from hicache.disagg.prefill_role import PrefillRole
from hicache.disagg.stats import DisaggStats
from hicache.disagg.zmq_decode import ZmqDecodeBackend
from hicache.disagg.zmq_prefill import ZmqPrefillBackend
from hicache.errors import UserError
from hicache.mem.host_group import DraftPools
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.model_runner import ModelRunner
from hicache.scheduler.role import Role
from hicache.scheduler.scheduler import Scheduler

PREFILL, DECODE = "prefill", "decode"


def radix_enabled(cfg: EngineConfig) -> bool:
    """Whether this server's cache keeps a tree (a decode server only when asked to)."""
    if cfg.disable_radix_cache:
        return False
    return cfg.disagg.disaggregation_mode != DECODE or cfg.disagg.disaggregation_decode_enable_radix_cache


def pd_role(
    cfg: EngineConfig, runner: ModelRunner, pctx: ParallelContext, identity: str, draft: DraftPools | None = None
) -> Role | None:
    """This rank's P/D role part for its scheduler, its transfer endpoint started; None without a role.
    `draft`: a speculative draft's pools, whose state the transfers move with the target's."""
    d = cfg.disagg
    if not d.enabled:
        return None
    spec = None
    if draft is not None:
        name = cfg.speculative.speculative_draft_model or ""
        spec = SpeculativeDraft(name, draft.identity, draft.pool, moved=not draft.skip_restore)
    handshake = Handshake.of(identity, runner.model, runner.pool, pctx, spec)
    moved = draft.pool if spec is not None and spec.moved else None
    if not handshake.verified:
        raise UserError(
            f"--disaggregation-mode {d.disaggregation_mode} needs the batch-invariance self-check to pass: KV "
            "moved between servers and extended in another batch shape could change answers on this machine"
        )
    if d.disaggregation_mode == PREFILL:
        pages = d.disaggregation_transfer_chunk_pages
        chunk = pages * cfg.page_size if pages else chunk_tokens(cfg.page_size, handshake.row_bytes)
        port = d.disaggregation_bootstrap_port + pctx.rank
        delay = d.debug_disagg_chunk_delay_ms / 1000
        transfer = ZmqPrefillBackend(
            handshake, d.disaggregation_bootstrap_host, port, d.disaggregation_transfer_timeout, chunk, delay
        )
        bootstrap = (d.disaggregation_bootstrap_host, d.disaggregation_bootstrap_port)
        # Every stage may send the draft's rows: to a decode stage of its own when both servers have one PP
        # size, else the last stage does (cells.draft_sources).
        return PrefillRole(transfer, pctx, handshake, bootstrap, moved)
    receiving = ZmqDecodeBackend(runner.pool, handshake, d.disaggregation_transfer_timeout, moved)
    return DecodeRole(receiving, pctx, handshake)


def info(scheduler: Scheduler) -> dict[str, Any]:
    """This rank's role, transfer endpoint and handshake (the `disagg_info` command); the role part
    fills in its own."""
    d = scheduler.cfg.disagg
    described = {
        "role": d.disaggregation_mode,
        "bootstrap_host": None,
        "bootstrap_port": None,
        "decode_radix_cache": d.disaggregation_decode_enable_radix_cache,
        "handshake": None,
    }
    return described if scheduler.role is None else {**described, **scheduler.role.info()}


def stats(scheduler: Scheduler) -> DisaggStats | None:
    """This rank's transfer counters (the `disagg_stats` command); None outside a P/D role."""
    return scheduler.role.stats() if scheduler.role is not None else None
