"""CP2 x TP2 (4 ranks): CP shards pages over the CP ranks of each TP rank's heads, and the multi-turn
workload with every tier gives the TP2 cache-off run token for token (TP2 changes bf16 sums against
TP1, CP changes none; see tests/dist/test_parallel_tiers.py)."""

import pytest

from hicache import Engine
from hicache.config import ParallelConfig
from tests.dist import workload as w
from tests.dist.test_cp_tiers import cp_engine
from tests.dist.test_parallel_tiers import run_equal_to


@pytest.mark.timeout(300)
def test_cp2_tp2_equals_tp2_cache_off(tmp_path):
    with Engine(model="tiny", disable_radix_cache=True, parallel=ParallelConfig(tp_size=2)) as engine:
        tp2_reference = w.run(engine)
    with cp_engine(tmp_path / "store", tp=2) as engine:
        run_equal_to(engine, tp2_reference)
