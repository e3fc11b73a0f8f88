"""The pipeline link (hicache/parallel/pipeline.py) between real ranks (TP2 x PP2, gloo on loopback):

- hidden states go from each first-stage rank to the rank of the same TP index on the next stage,
  bit for bit, whatever the sender's memory layout; the first stage receives nothing (it embeds);
- the sampling rank's tokens reach every rank, and a rank whose batch digest differs from the sampling
  rank's is named with a RankDivergenceError instead of appending tokens sampled for another batch;
- at one rank both messages are the identity.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hicache.parallel.divergence import RankDivergenceError
from hicache.parallel.parallel import Mesh, ParallelContext
from hicache.parallel.pipeline import StageLink
from tests.parallel.ranks import outcomes_of, report

MESH = Mesh(pp=2, tp=2)
TOKENS, HIDDEN = 5, 8
SAMPLES = [[17, 3], [250]]  # one list of new tokens per request, as the sampler returns them
DIGEST = 0x5EED


def hidden_of(tp_rank: int) -> torch.Tensor:
    """What the first stage's TP rank `tp_rank` sends: distinct per sender, exact in bfloat16."""
    values = torch.arange(TOKENS * HIDDEN, dtype=torch.float32).reshape(HIDDEN, TOKENS).t()  # non-contiguous
    return (values + 100 * tp_rank).to(torch.bfloat16)


def scenario(pctx: ParallelContext) -> dict:
    link = StageLink(pctx)
    out: dict = {"samples_here": link.samples_here}
    received = link.recv_hidden(TOKENS, HIDDEN, torch.bfloat16, torch.device("cpu"))
    out["received"] = None if received is None else received.float().tolist()
    if not pctx.is_last_stage:
        link.send_hidden(hidden_of(pctx.tp_rank))
    # Every rank ran the same batch: the sampling rank's tokens everywhere.
    out["samples"] = link.share_samples(SAMPLES if link.samples_here else None, DIGEST)
    # Rank 3's scheduler diverged: it ran another batch.
    digest = DIGEST + 1 if pctx.rank == 3 else DIGEST
    try:
        link.share_samples(SAMPLES if link.samples_here else None, digest)
        out["diverged"] = None
    except RankDivergenceError as exc:
        out["diverged"] = str(exc)
    return out


def _rank(rank: int, init: str, results) -> None:
    timeout = timedelta(seconds=30)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=MESH.world_size, timeout=timeout)
    pctx = ParallelContext.create(rank, MESH, "gloo", timeout)
    report(rank, scenario(pctx), pctx, results)


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict]:
    return outcomes_of(_rank, MESH.world_size)


@pytest.mark.slow
def test_hidden_states_reach_the_same_tp_index_on_the_next_stage_exactly(outcomes):
    assert outcomes[0]["received"] is None and outcomes[1]["received"] is None  # the first stage embeds
    assert outcomes[2]["received"] == hidden_of(0).float().tolist()  # rank 2 = (pp 1, tp 0) from rank 0
    assert outcomes[3]["received"] == hidden_of(1).float().tolist()  # rank 3 = (pp 1, tp 1) from rank 1


@pytest.mark.slow
def test_only_the_last_stages_first_tp_rank_samples(outcomes):
    assert [outcomes[r]["samples_here"] for r in range(4)] == [False, False, True, False]


def test_every_rank_appends_the_sampling_ranks_tokens(outcomes):
    assert all(outcomes[r]["samples"] == SAMPLES for r in range(4))


def test_a_rank_that_ran_another_batch_is_named(outcomes):
    message = outcomes[3]["diverged"]
    assert message is not None
    assert "rank 3 (tp1of2_pp1of2) ran a different batch than the sampling rank 2" in message
    assert [outcomes[r]["diverged"] for r in (0, 1, 2)] == [None, None, None]


def test_one_rank_is_the_identity():
    link = StageLink(ParallelContext())
    assert link.samples_here
    assert link.recv_hidden(TOKENS, HIDDEN, torch.float32, torch.device("cpu")) is None
    assert link.share_samples(SAMPLES, DIGEST) == SAMPLES
