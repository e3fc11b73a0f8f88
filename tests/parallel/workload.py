"""The multi-turn workload of the parallel tests: 10 conversations x 8 turns (80 requests) whose working
set is several times the device pool (device eviction every turn, host hits), with the in-memory tiers
flushed half-way so the next turns are served from storage."""

from __future__ import annotations

import random

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig
from tests.conversations import make_conversations

CONVS = make_conversations(num_groups=2, per_group=5, system_len=200, question_len=30)
TURNS = 8
FLUSH_AFTER = 4
NEW = 8
DEVICE_TOKENS = 2048
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=5)


def tiers(storage_dir, **kw) -> HiCacheConfig:
    return HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_storage_backend="file",
        hicache_storage_dir=str(storage_dir),
        hicache_storage_prefetch_threshold=64,
        **kw,
    )


def run(engine: Engine) -> list[list]:
    """Per turn, the results of every conversation (all advance one turn at a time, concurrently).
    Stops after a turn with a failed request (the engine has failed), returning what it has."""
    histories = [list(c["system"]) for c in CONVS]
    rngs = [random.Random(c["seed"]) for c in CONVS]
    turns = []
    for turn in range(TURNS):
        if turn == FLUSH_AFTER:
            assert engine.flush_cache()
        for h, c, rng in zip(histories, CONVS, rngs):
            h.extend(rng.randrange(32, 127) for _ in range(c["qlen"]))
        results = engine.generate([list(h) for h in histories], PARAMS)
        turns.append(results)
        if any(r.error is not None for r in results):
            break
        for h, r in zip(histories, results):
            h.extend(r.token_ids)
    return turns


def errors(turns) -> list[str]:
    return [r.error for results in turns for r in results if r.error is not None]


def tokens(turns) -> list[list[list[int]]]:
    return [[r.token_ids for r in results] for results in turns]


def tier_totals(turns) -> dict[str, int]:
    totals = {"device": 0, "host": 0, "storage": 0}
    for results in turns:
        for r in results:
            for tier, n in r.cached_tokens_by_tier.items():
                totals[tier] += n
    return totals
