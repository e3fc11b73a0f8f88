"""One answer on every TP size: KV written by one topology and read by another never changes a token or
a log-probability (hicache/model/kernels/tp_groups.py).

A conversation of three turns moves across topologies through one unified-layout file store
(--hicache-storage-key-scheme unified): its first turn is served by TP2 x PP2 (or TP2 x CP2), its
second by TP1 reading what they stored, its third by TP2 reading what TP1 stored. Each turn starts
on a fresh engine, so everything it reuses comes from storage, and each gives the single-rank
cache-off run's tokens and top-5 log-probabilities bit for bit, in bfloat16 (where TP sums used to
differ from TP1's in the last bits) and float32, for `tiny` and `tiny-mla`.
"""

from __future__ import annotations

import functools

import pytest

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig, ParallelConfig

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PAGE = 16
SYSTEM = [32 + (i * 7) % 90 for i in range(256)]  # every conversation's shared system prompt
QUESTIONS = 3  # conversations
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=5)
# (tp, pp, cp) of each turn: the first writes the store, each later one reads what the one before wrote.
TURNS = [(2, 2, 1), (1, 1, 1), (2, 1, 1)]
CP_TURNS = [(2, 1, 2), (1, 1, 1)]
CASES = [("tiny", "bfloat16", TURNS), ("tiny", "float32", TURNS), ("tiny-mla", "bfloat16", TURNS),
         ("tiny", "bfloat16", CP_TURNS)]  # fmt: skip


def question(conversation: int, turn: int) -> list[int]:
    return [33 + (conversation * 31 + turn * 17 + i * 5) % 80 for i in range(24)]


def engine(model: str, dtype: str, store: str, tp: int, pp: int, cp: int) -> Engine:
    tiers = HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=store,
        # a conversation's own pages past the shared prompt are worth loading too, not recomputed
        hicache_storage_prefetch_threshold=PAGE,
        hicache_load_back_threshold=PAGE,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_key_scheme="unified",
        hicache_storage_layer_partition=2,  # the PP2 boundary of tiny's four layers
        hicache_storage_head_partition=1,
    )
    return Engine(model=model, dtype=dtype, page_size=PAGE, hicache=tiers,
                  parallel=ParallelConfig(tp_size=tp, pp_size=pp, cp_size=cp))  # fmt: skip


def answers(results) -> list[tuple]:
    """What a client sees of each request: its tokens and every token's log-probabilities, exactly."""
    assert [r.error for r in results] == [None] * len(results)
    return [(r.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in r.logprobs]) for r in results]


def next_prompts(prompts: list[list[int]], results, turn: int) -> list[list[int]]:
    return [p + list(r.token_ids) + question(c, turn) for c, (p, r) in enumerate(zip(prompts, results))]


@functools.cache
def cache_off(model: str, dtype: str, turns: int) -> tuple[list[list[list[int]]], list[list[tuple]]]:
    """Each turn's prompts and the single-rank cache-off run's answers to them."""
    prompts = [SYSTEM + question(c, 0) for c in range(QUESTIONS)]
    all_prompts, all_answers = [], []
    with Engine(model=model, dtype=dtype, page_size=PAGE, disable_radix_cache=True) as e:
        for turn in range(turns):
            results = e.generate(prompts, PARAMS)
            all_prompts.append(prompts)
            all_answers.append(answers(results))
            prompts = next_prompts(prompts, results, turn + 1)
    return all_prompts, all_answers


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model,dtype,turns", CASES, ids=[f"{m}-{d}-" + "-".join(f"tp{t}pp{p}cp{c}" for t, p, c in turns)
                                     for m, d, turns in CASES])  # fmt: skip
def test_a_conversation_moving_across_tp_sizes_keeps_the_single_rank_answer(tmp_path, model, dtype, turns):
    prompts, want = cache_off(model, dtype, len(turns))
    for turn, (tp, pp, cp) in enumerate(turns):
        with engine(model, dtype, str(tmp_path), tp, pp, cp) as e:
            # One conversation after another, as their users send them: each finds in storage all that
            # the topology before stored of it (the system prompt, then in memory for the others).
            results = [e.generate([p], PARAMS)[0] for p in prompts[turn]]
            assert answers(results) == want[turn], (turn, tp, pp, cp)
            if turn > 0:  # a fresh engine: what it reuses came from the store the last topology wrote
                tiers = [r.cached_tokens_by_tier for r in results]
                written = [len(p) // PAGE * PAGE for p in prompts[turn - 1]]
                assert all(sum(t.values()) >= 0.9 * w for t, w in zip(tiers, written)), (turn, tiers)
                assert sum(t["storage"] for t in tiers) >= 0.9 * max(written), (turn, tiers)
            assert e.flush_cache()  # its puts are done before the next topology reads
