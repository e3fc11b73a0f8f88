"""Context parallelism keeps the cache invariant with page-sharded KV on every tier: CP ranks split each
step's rows, own alternate pages of one logical tree, back up and restore only their own pages, and
store them under keys with their CP rank; the multi-turn workload (device eviction every turn, host
hits, the in-memory tiers flushed half-way so later turns come from storage) gives, token for token,
the single-rank cache-off run (CP adds no float sum: attention runs over the gathered full KV), at TP2
the TP2 cache-off run. Every copy lands up to 50 ms late, in another rhythm on every rank, and the rank
consensus checker finds every rank's decisions (admissions, rotation bases, per-class allocations,
agreed ACKs and storage hits) equal.
"""

import random

import pytest

from hicache import Engine
from hicache.config import DebugConfig, ParallelConfig
from tests.parallel import workload as w
from tests.parallel.test_parallel_tiers import assert_clean, assert_ranks_agree, checked_engine, run_equal_to

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


@pytest.fixture(scope="module")
def reference():
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        return w.run(engine)


def cp_engine(storage_dir, cp=2, tp=1, pp=1, delay_ms=0.0) -> Engine:
    return Engine(
        model="tiny",
        max_total_tokens=w.DEVICE_TOKENS // 2,  # per rank: the logical pool stays below the working set
        hicache=w.tiers(storage_dir),
        parallel=ParallelConfig(cp_size=cp, tp_size=tp, pp_size=pp),
        debug=DebugConfig(debug_transfer_delay_ms=delay_ms),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [1, 2], ids=["cp2", "cp2pp2"])
def test_cp2_with_delayed_transfers_equals_single_rank_cache_off(reference, tmp_path, monkeypatch, pp):
    """At PP2 each stage's CP pair shards its layers' pages alike; the first stage's agreed decisions
    go down the pipeline as without CP."""
    with checked_engine(
        monkeypatch, tmp_path / "logs", lambda: cp_engine(tmp_path / "store", pp=pp, delay_ms=50)
    ) as engine:
        turns = run_equal_to(engine, reference)
        assert sum(len(t) for t in turns) == len(w.CONVS) * w.TURNS
        stats = engine.cache_stats()
        assert stats.host.load_pages > 0 and stats.storage.prefetch.inserted > 0, stats
    assert_ranks_agree(tmp_path / "logs", 2 * pp)


def test_a_cp2_store_is_read_after_a_restart_by_cp2(reference, tmp_path):
    """The restarted ranks know nothing; a prompt's first lookup asks storage for each rotation base,
    finds the one its pages were written from, and reads them back onto their writers' ranks."""
    prompts = first_turn_prompts()
    leaders = [prompts[0], prompts[len(prompts) // 2]]  # one per system prompt: nothing else shares them
    with cp_engine(tmp_path / "store") as engine:
        first = engine.generate(prompts, w.PARAMS)
    assert [r.token_ids for r in first] == w.tokens(reference)[0]
    with cp_engine(tmp_path / "store") as engine:
        for prompt in leaders:
            (r,) = engine.generate([prompt], w.PARAMS)
            assert r.cached_tokens_by_tier["storage"] >= 0.9 * len(prompt), r.cached_tokens_by_tier
        again = engine.generate(prompts, w.PARAMS)
        assert_clean(engine)
    assert [r.token_ids for r in again] == w.tokens(reference)[0]


def first_turn_prompts() -> list[list[int]]:
    """The workload's first-turn prompts (its runs draw the questions from the same seeds)."""
    prompts = []
    for c in w.CONVS:
        rng = random.Random(c["seed"])
        prompts.append(list(c["system"]) + [rng.randrange(32, 127) for _ in range(c["qlen"])])
    return prompts
