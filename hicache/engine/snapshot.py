"""What one scrape reads (`/metrics`, the benchmarks' counters): every rank's counters taken in one
command between two steps, combined into one typed record. A feature that reports something adds a
field here, not another command, engine method and exporter call."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Sequence

from hicache.cache import CacheStats
from hicache.disagg import roles
from hicache.disagg.stats import DisaggStats
from hicache.model.attention.kv_gather import GatherStats
from hicache.scheduler.scheduler import Scheduler
from hicache.spec.stats import SpecStats


@dataclass(frozen=True)
class RankSnapshot:
    """One rank's counters (its own bytes: with sharded pages each rank holds about 1/N of one rank's)."""

    pool_usage: dict[str, tuple[int, int]]
    cache: CacheStats
    kv_bytes: dict[str, int]  # per tier, and the CP gather's scratch
    spec: SpecStats | None
    disagg: DisaggStats | None
    gather: GatherStats | None  # what the CP gather cost so far (None for unsharded attention)


def take_snapshot(s: Scheduler) -> RankSnapshot:
    attention = s.runner.model.attention
    return RankSnapshot(
        pool_usage=s.cache.usage(),
        cache=s.cache.stats(),
        # The CP gather's two layer buffers (hicache/model/attention/kv_gather.py); 0 for unsharded attention.
        kv_bytes={**s.cache.resident_bytes(), "scratch": int(getattr(attention, "scratch_bytes", 0))},
        spec=s.compute.stats() if s.compute.speculative else None,
        disagg=roles.stats(s),
        gather=copy.copy(getattr(attention, "stats", None)),  # the live counters go on counting
    )


@dataclass(frozen=True)
class Snapshot:
    """The deployment's counters at one scrape. `running` and `waiting` are the engine front's counts
    (requests posted but not yet taken by a rank are waiting too), filled in by `Engine.snapshot`."""

    pool_usage: dict[str, tuple[int, int]]  # (used, capacity) tokens per tier: logical, the same on every rank
    cache: CacheStats
    kv_bytes_by_rank: dict[str, dict[str, int]]  # per rank: the point is that they differ from one rank's
    gather_by_rank: dict[str, GatherStats | None]
    spec: SpecStats | None
    disagg: DisaggStats | None
    running: int = 0
    waiting: int = 0

    @classmethod
    def combine(cls, ranks: Sequence[RankSnapshot], names: Sequence[str]) -> Snapshot:
        first = ranks[0]
        disagg = [r.disagg for r in ranks if r.disagg is not None]
        return cls(
            pool_usage=first.pool_usage,
            cache=CacheStats.worst([r.cache for r in ranks]),
            kv_bytes_by_rank={name: r.kv_bytes for name, r in zip(names, ranks)},
            gather_by_rank={name: r.gather for name, r in zip(names, ranks)},
            spec=first.spec,  # speculative decoding runs on one rank
            disagg=DisaggStats.combine(disagg) if disagg else None,
        )

    def with_queues(self, running: int, waiting: int) -> Snapshot:
        return replace(self, running=running, waiting=waiting)
