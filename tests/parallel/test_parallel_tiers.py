"""TP and PP ranks keep the cache invariant with host and storage tiers: every rank has its own tree,
pools and transfer workers, and they agree (hicache/parallel/consensus.py) on what their asynchronous
copies and storage reads have delivered.

Reference runs: PP does not change any sum, and TP computes every projection in the same fixed groups,
summed in the same order, at every TP size (hicache/model/kernels/tp_groups.py), so PP2, TP2 and TP2xPP2 equal
the single-rank cache-off run bit for bit: its tokens and every token's top-5 log-probabilities (in
bfloat16, where TP2's all-reduced partials used to flip about a third of tiny's continuations).
"""

import subprocess
import sys
from collections.abc import Callable

import pytest

from hicache import Engine
from hicache.cache.stats import PrefetchLoss
from hicache.config import DebugConfig, ParallelConfig
from hicache.debug.consensus_checker import DIVERGENCE, ENV_ENABLE, ENV_LOG_DIR
from tests.cache.test_hicache import assert_clean
from tests.parallel import workload as w

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


@pytest.fixture(scope="module")
def tp1_reference():
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        return w.run(engine)


@pytest.fixture(scope="module")
def tp2_reference():
    with Engine(model="tiny", disable_radix_cache=True, parallel=ParallelConfig(tp_size=2)) as engine:
        return w.run(engine)


def cached_engine(storage_dir, tp=1, pp=1, debug: DebugConfig | None = None) -> Engine:
    return Engine(
        model="tiny",
        max_total_tokens=w.DEVICE_TOKENS,
        hicache=w.tiers(storage_dir),
        parallel=ParallelConfig(tp_size=tp, pp_size=pp),
        debug=debug or DebugConfig(),
    )


def assert_every_tier_served(turns) -> None:
    totals = w.tier_totals(turns)
    assert all(totals[tier] > 0 for tier in ("device", "host", "storage")), totals


def run_equal_to(engine: Engine, reference) -> list:
    """Run the workload: no request fails, the tokens equal `reference`'s, every tier served, no leak."""
    turns = w.run(engine)
    assert w.errors(turns) == []
    assert w.tokens(turns) == w.tokens(reference)
    assert_every_tier_served(turns)
    assert_clean(engine)
    return turns


def test_pp2_equals_single_rank_cache_off(tp1_reference, tmp_path):
    with cached_engine(tmp_path / "store", pp=2) as engine:
        run_equal_to(engine, tp1_reference)


def logprobs(turns) -> list:
    return [[r.logprobs for r in results] for results in turns]


def test_tp2_cache_off_equals_tp1_bit_for_bit_and_tp2_cached_equals_both(tp1_reference, tp2_reference, tmp_path):
    assert w.tokens(tp2_reference) == w.tokens(tp1_reference)
    assert logprobs(tp2_reference) == logprobs(tp1_reference)  # every token's top 5, exactly
    with cached_engine(tmp_path / "store", tp=2) as engine:
        assert logprobs(run_equal_to(engine, tp1_reference)) == logprobs(tp1_reference)


def checked_engine(monkeypatch, log_dir, start: Callable[[], Engine]) -> Engine:
    """The engine `start` makes, its ranks recording their cache decisions in `log_dir` for the checker."""
    monkeypatch.setenv(ENV_ENABLE, "1")
    monkeypatch.setenv(ENV_LOG_DIR, str(log_dir))
    engine = start()
    monkeypatch.delenv(ENV_ENABLE)  # the ranks read it when they started; later engines run unchecked
    return engine


def assert_ranks_agree(log_dir, ranks: int) -> None:
    checked = consensus_check(log_dir)
    assert checked.returncode == 0 and f"{ranks} ranks agree" in checked.stdout, checked.stdout + checked.stderr


def _delayed_run(storage_dir, log_dir, monkeypatch, disable_pp_sync: bool):
    debug = DebugConfig(debug_transfer_delay_ms=50, debug_disable_pp_sync=disable_pp_sync)
    return checked_engine(monkeypatch, log_dir, lambda: cached_engine(storage_dir, tp=2, pp=2, debug=debug))


def consensus_check(log_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hicache", "consensus-check", str(log_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(180)
def test_tp2_pp2_with_delayed_transfers_agree_and_equal(tp1_reference, tmp_path, monkeypatch):
    """80 multi-turn requests, every copy completing up to 50 ms late in a different order on each
    rank: the checker finds every rank's decisions equal, and so are the outputs."""
    with _delayed_run(tmp_path / "store", tmp_path / "logs", monkeypatch, disable_pp_sync=False) as engine:
        turns = run_equal_to(engine, tp1_reference)
        assert sum(len(t) for t in turns) == len(w.CONVS) * w.TURNS
    assert_ranks_agree(tmp_path / "logs", 4)


@pytest.mark.timeout(180)
def test_disabled_pp_sync_is_caught_not_silent(tp1_reference, tmp_path, monkeypatch):
    """The negative control: later stages poll their own ACK queues. The checker stops the engine at
    the first diverging decision and names the ranks; every answer delivered before is correct."""
    with _delayed_run(tmp_path / "store", tmp_path / "logs", monkeypatch, disable_pp_sync=True) as engine:
        turns = w.run(engine)
        reason = engine.fatal_error
    assert reason is not None and DIVERGENCE in reason, reason
    assert "differ from rank 0" in reason and "tp" in reason
    assert w.errors(turns), "the engine failed, so the requests in flight must have failed"
    reference = w.tokens(tp1_reference)
    for turn, results in enumerate(turns):
        for conv, r in enumerate(results):
            if r.error is None:
                assert r.token_ids == reference[turn][conv]
    checked = consensus_check(tmp_path / "logs")
    assert checked.returncode == 1
    assert DIVERGENCE in checked.stdout


def test_storage_reads_failing_on_one_rank_shorten_every_rank(tp1_reference, tmp_path, monkeypatch):
    """Rank 1 (the second pipeline stage) fails a tenth of its storage page reads; every rank takes the
    shorter prefix (the checker compares their admissions), and the outputs do not change."""
    debug = DebugConfig(debug_storage_fail_rate=0.1, debug_storage_fail_rank=1)
    with checked_engine(
        monkeypatch, tmp_path / "logs", lambda: cached_engine(tmp_path / "store", pp=2, debug=debug)
    ) as engine:
        turns = w.run(engine)
        assert w.errors(turns) == []
        assert w.tokens(turns) == w.tokens(tp1_reference)
        stats = engine.cache_stats()
        assert stats.storage.store.misses > 0 and stats.storage.prefetch.lost[PrefetchLoss.READ_FAILED] > 0, stats
        assert w.tier_totals(turns)["storage"] > 0
        assert_clean(engine)
    assert consensus_check(tmp_path / "logs").returncode == 0
