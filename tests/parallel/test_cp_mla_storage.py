"""SGLang #37149 as an end-to-end check: `tiny-mla` at CP2 x TP2 shards its latent pages over the CP
ranks, and each CP rank's two TP ranks hold the same bytes. The writer is elected per shard rank (TP
rank 0 of each CP rank, hicache/parallel/placement.py), so both CP ranks' pages reach storage and a fresh
CP2 x TP2 reader's agreed hit (the MIN over the shard group) covers the prompt, not 0."""

import pytest

from tests.parallel import workload as w
from tests.parallel.test_cp_mla import mla_engine
from tests.parallel.test_cp_tiers import first_turn_prompts

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


@pytest.mark.timeout(240)
def test_mla_cp2_tp2_every_shard_rank_writes_and_a_restart_reads_them(tmp_path):
    prompts = first_turn_prompts()
    leaders = [prompts[0], prompts[len(prompts) // 2]]
    with mla_engine(tmp_path / "store", cp=2, tp=2) as engine:
        first = [engine.generate([p], w.PARAMS)[0] for p in leaders]
    # Objects are named {page hash}_{namespace digest}; the namespace names the shard rank that wrote it.
    writers = {path.name.rsplit("_", 1)[1] for path in (tmp_path / "store").rglob("*_*") if path.is_file()}
    assert len(writers) == 2, writers  # one per CP rank (TP ranks share their CP rank's key)
    with mla_engine(tmp_path / "store", cp=2, tp=2) as engine:
        for prompt, before in zip(leaders, first):
            (r,) = engine.generate([prompt], w.PARAMS)
            assert r.token_ids == before.token_ids
            assert r.cached_tokens_by_tier["storage"] >= 0.9 * len(prompt), r.cached_tokens_by_tier
