"""CP page sharding in the simulator: a simulated CP2 server (rank 0's sharded pool, its owner classes
and tiers) hits as a real CP2 engine (two rank processes) request by request, device only and with a
host tier, on a logical pool below the trace's working set; and CP sharding at the same per-rank pool
serves from the device what replicated KV loses to eviction. (One real configuration, device + host: a CP2
engine starts two rank processes, the test's cost; it has device and host hits both.)"""

import pytest

from hicache import Engine, SamplingParams
from hicache.config import EngineConfig, HiCacheConfig, ParallelConfig
from hicache.sim.cost import load_cost_model
from hicache.sim.simulator import Simulator
from tests.sim.test_simulate import HOST, NEW, PAGE, PROMPTS, _trace

RANK_TOKENS = 640  # per rank: CP2's logical pool (1,280) is below the working set (1,536 tokens)


def _config(hc: HiCacheConfig, cp: int) -> EngineConfig:
    return EngineConfig(model="tiny", page_size=PAGE, max_total_tokens=RANK_TOKENS, hicache=hc,
                        parallel=ParallelConfig(cp_size=cp))  # fmt: skip


def _simulated(cfg: EngineConfig) -> list[dict[str, int]]:
    simulator = Simulator(cfg, load_cost_model("epyc-2core-tiny"))
    try:
        return [r.cached_tokens_by_tier for r in simulator.run(_trace())]
    finally:
        simulator.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_simulated_cp2_server_hits_as_a_real_one_request_by_request():
    cfg = _config(HOST, cp=2)
    with Engine(cfg) as engine:
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        real = [engine.generate([p], params)[0].cached_tokens_by_tier for p in PROMPTS]
    assert _simulated(cfg) == real
    # The trace must exercise what it compares: the device loses prefixes to eviction, the host serves them.
    assert sum(hits["device"] for hits in real) > 0 and sum(hits["host"] for hits in real) > 0, real


def test_cp_sharding_holds_more_on_the_device_than_replicated_kv_at_the_same_rank_pool():
    """Replicated, each rank holds every page: the pool of one rank is the logical pool."""
    replicated, sharded = (sum(h["device"] for h in _simulated(_config(HiCacheConfig(), cp))) for cp in (1, 2))
    assert replicated < sharded, (replicated, sharded)
