"""CP2 x TP2 (4 ranks): CP shards pages over the CP ranks of each TP rank's heads, and the multi-turn
workload with every tier gives the TP2 cache-off run token for token (TP2 changes bf16 sums against
TP1, CP changes none; see tests/parallel/test_parallel_tiers.py)."""

import pytest

from hicache import Engine
from hicache.config import ParallelConfig
from hicache.debug.consensus_checker import ENV_ENABLE, ENV_LOG_DIR
from tests.parallel import workload as w
from tests.parallel.test_cp_tiers import cp_engine
from tests.parallel.test_parallel_tiers import consensus_check, run_equal_to


@pytest.mark.timeout(300)
def test_cp2_tp2_equals_tp2_cache_off(tmp_path, monkeypatch):
    with Engine(model="tiny", disable_radix_cache=True, parallel=ParallelConfig(tp_size=2)) as engine:
        tp2_reference = w.run(engine)
    monkeypatch.setenv(ENV_ENABLE, "1")
    monkeypatch.setenv(ENV_LOG_DIR, str(tmp_path / "logs"))
    engine = cp_engine(tmp_path / "store", tp=2)
    monkeypatch.delenv(ENV_ENABLE)
    with engine:
        run_equal_to(engine, tp2_reference)
    checked = consensus_check(tmp_path / "logs")  # the tree is agreed over all four (CP x TP) ranks
    assert checked.returncode == 0 and "4 ranks agree" in checked.stdout, checked.stdout + checked.stderr
