"""CP2 x TP2 (4 ranks): CP shards pages over the CP ranks of each TP rank's heads, and the multi-turn
workload with every tier gives the TP2 cache-off run token for token (TP2 changes bf16 sums against
TP1, CP changes none; see tests/parallel/test_parallel_tiers.py)."""

import pytest

from hicache import Engine
from hicache.config import ParallelConfig
from tests.parallel import workload as w
from tests.parallel.test_cp_tiers import cp_engine
from tests.parallel.test_parallel_tiers import assert_ranks_agree, checked_engine, run_equal_to

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


@pytest.mark.timeout(300)
def test_cp2_tp2_equals_tp2_cache_off(tmp_path, monkeypatch):
    with Engine(model="tiny", disable_radix_cache=True, parallel=ParallelConfig(tp_size=2)) as engine:
        tp2_reference = w.run(engine)
    with checked_engine(monkeypatch, tmp_path / "logs", lambda: cp_engine(tmp_path / "store", tp=2)) as engine:
        run_equal_to(engine, tp2_reference)
    assert_ranks_agree(tmp_path / "logs", 4)  # the tree is agreed over all four (CP x TP) ranks
