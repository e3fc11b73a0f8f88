"""`tiny-mla` (one latent KV row per token and layer) at CP2 with page-sharded KV and every cache tier:
the multi-turn workload gives the single-rank cache-off run token for token, and the rank consensus
checker finds every decision equal."""

import pytest

from hicache import Engine
from hicache.config import ParallelConfig
from tests.parallel import workload as w
from tests.parallel.test_parallel_tiers import assert_ranks_agree, checked_engine, run_equal_to

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


def mla_engine(storage_dir, cp=1, tp=1) -> Engine:
    return Engine(
        model="tiny-mla",
        max_total_tokens=w.DEVICE_TOKENS // 2,  # per rank: the logical pool stays below the working set
        hicache=w.tiers(storage_dir),
        parallel=ParallelConfig(cp_size=cp, tp_size=tp),
    )


@pytest.mark.timeout(240)
def test_tiny_mla_cp2_equals_single_rank_cache_off(tmp_path, monkeypatch):
    with Engine(model="tiny-mla", disable_radix_cache=True) as engine:
        reference = w.run(engine)
    with checked_engine(monkeypatch, tmp_path / "logs", lambda: mla_engine(tmp_path / "store", cp=2)) as engine:
        run_equal_to(engine, reference)
    assert_ranks_agree(tmp_path / "logs", 2)
