"""P/D composed with what the seed's deployments run beside it, where no start-up check refuses the
combination: pipeline parallelism on both sides, host memory and a file store on the prefill side, and
a decode server whose reuse reaches into host memory and its own file store in the unified layout
(`--hicache-storage-key-scheme unified`; read again after the decode server restarts). Greedy tokens
and logprobs equal one single-rank cache-off engine's, turn after turn, and the decode side's reuse is
counted where it happened."""

from __future__ import annotations

import random

import pytest

from hicache import Engine, SamplingParams
from hicache.config import DisaggConfig, EngineConfig, HiCacheConfig, ParallelConfig
from tests.disagg.pd import PDPair, free_ports
from tests.disagg.test_engines import assert_no_leaks, conversations, extend

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)


def tiers(store: str, key_scheme: str) -> HiCacheConfig:
    return HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_load_back_threshold=16,
                         hicache_storage_backend="file", hicache_storage_dir=store,
                         hicache_storage_prefetch_policy="wait_complete",
                         hicache_storage_key_scheme=key_scheme,
                         hicache_storage_layer_partition=2 if key_scheme == "unified" else 0)  # fmt: skip


def engine(mode: str, store: str, port: int, pp: int, max_total_tokens: int) -> Engine:
    disagg = DisaggConfig(disaggregation_mode=mode, disaggregation_bootstrap_port=port,
                          disaggregation_decode_enable_radix_cache=mode == "decode")  # fmt: skip
    # Prefill's store is named per rank, decode's in the unified layout (cells of 2 layers: one PP2 stage's
    # layers each): both schemes serve a P/D side.
    scheme = "unified" if mode == "decode" else "rank-suffix"
    return Engine(EngineConfig(model="tiny", max_total_tokens=max_total_tokens, hicache=tiers(store, scheme),
                               disagg=disagg, parallel=ParallelConfig(pp_size=pp)))  # fmt: skip


def test_pp2_pair_with_host_and_storage_on_both_sides_equals_one_cache_off_engine(tmp_path):
    port = free_ports(2)
    histories = conversations(2, 2, 200, seed=3)
    rng = random.Random(3)
    extend(histories, [[]] * 4, rng)
    with Engine(EngineConfig(model="tiny", disable_radix_cache=True)) as ref:
        reused = []
        prefill = decode = None
        try:
            prefill = engine("prefill", str(tmp_path / "prefill-store"), port, pp=2, max_total_tokens=1024)
            # A decode pool smaller than the four histories: the others live in host memory between turns.
            decode = engine("decode", str(tmp_path / "decode-store"), port, pp=2, max_total_tokens=512)
            pair = PDPair(prefill, decode, port)
            for turn in range(3):
                if turn == 2:  # the decode server restarts: its reuse comes back from its own store
                    decode.shutdown()
                    decode = engine("decode", str(tmp_path / "decode-store"), port, pp=2, max_total_tokens=512)
                    pair = PDPair(prefill, decode, port, seed=turn)
                got = pair.run(histories, PARAMS)
                expected = ref.generate(histories, PARAMS)
                for g, e in zip(got, expected):
                    assert g.prefill.error is None and g.decode.error is None, (g.prefill.error, g.decode.error)
                    assert g.decode.token_ids == e.token_ids, f"turn {turn}: tokens differ from one cache-off engine"
                    assert g.decode.logprobs == e.logprobs, f"turn {turn}: logprobs differ"
                reused.append([g.decode_prefix_tokens for g in got])
                by_tier = [g.decode.disagg.decode_prefix_by_tier for g in got]
                if turn == 1:  # the decode pool holds less than the four histories: some come from host
                    assert sum(t["host"] for t in by_tier) > 0
                if turn == 2:
                    assert sum(t["storage"] for t in by_tier) > 0
                extend(histories, [g.decode.token_ids for g in got], rng)
            assert all(d > 0 for d in reused[1]), "the second turn reuses each history on decode"
            assert_no_leaks(prefill, decode)
        finally:
            for started in (prefill, decode):
                if started is not None:
                    started.shutdown()
