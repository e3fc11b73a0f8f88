"""`tiny-mla` at TP2 without CP: the latent is replicated over attention TP, so its pages are sharded over
the TP ranks the same way as over CP ranks (each holds half and gathers the rest per layer); the
multi-turn workload with every tier gives the TP2 cache-off run token for token."""

import pytest

from hicache import Engine
from hicache.config import ParallelConfig
from tests.parallel import workload as w
from tests.parallel.test_cp_mla import mla_engine
from tests.parallel.test_parallel_tiers import run_equal_to

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


@pytest.mark.timeout(240)
def test_tiny_mla_tp2_shards_its_latent_pages_over_tp_and_equals_tp2_cache_off(tmp_path):
    with Engine(model="tiny-mla", disable_radix_cache=True, parallel=ParallelConfig(tp_size=2)) as engine:
        reference = w.run(engine)
    with mla_engine(tmp_path / "store", tp=2) as engine:
        run_equal_to(engine, reference)
        engine.generate([list(range(40, 40 + 16 * 9))], w.PARAMS)  # 9 pages cached and backed up
        by_rank = engine.kv_bytes_by_rank()
    device = [b["device"] for b in by_rank.values()]
    assert len(device) == 2 and abs(device[0] - device[1]) <= max(device) // 4, by_rank
