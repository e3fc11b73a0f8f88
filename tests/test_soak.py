"""The short soak (benchmarks/soak.py has the long one): 16 concurrent multi-turn clients against a real
`hicache serve` with device, host and storage tiers, while clients disconnect and abandon streams,
stored objects are corrupted and truncated, Redis restarts, the server restarts half way and every
transfer is delayed. Every completed answer equals the cache-off server's; nothing leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import SoakConfig, run_soak

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_soak_under_faults_answers_equal_cache_off_and_nothing_leaks(backend: str, tmp_path: Path):
    report = run_soak(SoakConfig(backend=backend, clients=16, turns=4), tmp_path)
    summary = f"{report}"
    assert report.wrong_answers == [], summary
    assert report.errors_without_message == 0, summary
    assert report.leaks == [] and set(report.pool_used_after_flush.values()) == {0.0}, summary
    assert report.still_answers, summary
    outcomes = report.by_outcome
    assert outcomes.get("completed", 0) >= report.requests // 2, summary
    assert outcomes.get("stream_abandoned", 0) + outcomes.get("client_disconnected", 0) > 0, summary
    # The faults happened and the server saw them as faults, never as answers.
    assert report.faults.get("objects_truncated", 0) + report.faults.get("objects_corrupted", 0) > 0, summary
    if backend == "redis":
        assert report.faults.get("redis_restarted") == 1, summary
    assert report.cached_tokens_by_tier.get("storage", 0) > 0, summary  # read back after the restart
    # Bounded: a connection or two per client at most, and no runaway memory in one run.
    assert report.open_fds[1] <= report.open_fds[0] + 2 * 16 + 8, summary
    assert report.rss_mb[1] <= report.rss_mb[0] + 300, summary
