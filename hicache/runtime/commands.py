"""Control commands (docs/DESIGN.md, "runtime") the engine front runs on the scheduler between two steps
(flush, leak report, cache counters, pool usage, the batch-invariance self-check's report), by name,
so that with several ranks the same command can be broadcast to every rank and the per-rank answers
combined into one."""

from __future__ import annotations

from typing import Callable, Sequence

from hicache.cache.stats import CacheStats
from hicache.disagg import roles
from hicache.disagg.stats import DisaggStats
from hicache.engine.scheduler import Scheduler


def _scratch_bytes(s: Scheduler) -> int:
    """The CP gather's two layer buffers (hicache/model/attention/kv_gather.py); 0 for unsharded attention."""
    return int(getattr(s.runner.model.attention, "scratch_bytes", 0))


COMMANDS: dict[str, Callable[[Scheduler], object]] = {
    "flush": lambda s: s.flush(),
    "leak_report": lambda s: s.leak_report(),
    "cache_stats": lambda s: s.cache.stats(),
    "pool_usage": lambda s: s.cache.usage(),
    "invariance": lambda s: s.runner.model.invariance.to_json(),
    "spec_stats": lambda s: s.compute.stats() if s.compute.speculative else None,  # type: ignore[attr-defined]
    # This rank's own bytes: with sharded pages each rank holds about 1/N of what one rank would.
    "kv_bytes": lambda s: {**s.cache.resident_bytes(), "scratch": _scratch_bytes(s)},
    # What the CP gather cost so far (None for unsharded attention): benchmarks/cp_bench.py.
    "gather_stats": lambda s: getattr(s.runner.model.attention, "stats", None),
    "disagg_info": roles.info,
    "disagg_stats": roles.stats,
}


def combine(command: str, answers: Sequence[object], names: Sequence[str]) -> object:
    """One answer from every rank's, in rank order (`names`: each rank's tp/pp suffix)."""
    if command == "flush":
        return all(answers)  # every rank refuses or accepts alike; a mix would itself be a divergence
    if command == "leak_report":
        reports: Sequence[list[str]] = answers  # type: ignore[assignment]
        return [f"{name}: {problem}" for name, problems in zip(names, reports) for problem in problems]
    if command == "cache_stats":
        return CacheStats.worst(answers)  # type: ignore[arg-type]
    if command == "spec_stats":
        return answers[0]  # speculative decoding runs on one rank
    if command in ("kv_bytes", "gather_stats"):
        return dict(zip(names, answers))  # per rank: the point is that they differ from one rank's
    if command == "pool_usage":
        return answers[0]  # token counts are logical: the same on every rank
    if command == "invariance":
        # Every rank checked its own shard: the deployment is verified only if all of them are.
        checks: Sequence[dict] = answers  # type: ignore[assignment]
        return {
            "verified": all(c["verified"] for c in checks),
            "mechanisms": checks[0]["mechanisms"],
            "detail": "; ".join(f"{name}: {c['detail']}" for name, c in zip(names, checks) if c["detail"]),
        }
    if command == "disagg_info":
        return answers[0]  # rank 0's shard stands for the deployment; every rank checks its own per transfer
    if command == "disagg_stats":
        records: Sequence[DisaggStats | None] = answers  # type: ignore[assignment]
        return None if records[0] is None else DisaggStats.combine(records)  # type: ignore[arg-type]
    raise ValueError(f"unknown control command {command!r}")
