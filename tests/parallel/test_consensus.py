"""The agreement protocol on real ranks (TP2 x PP2, gloo on loopback), with hand-made ACK queues:

- TP: the first stage's ranks agree on the MIN of their ready counts;
- pp_sync: later stages receive that count instead of polling, consume exactly that prefix (waiting for
  a copy of theirs still running), and leave their extra ready ACKs queued;
- identities: a rank that consumed different operations is named at the next agreement, whether it is
  a later stage (compared with what stage 0 sent) or a TP peer of the first stage (compared inside the
  reduction);
- storage threads' MIN over every rank.
"""

import threading
import time

import pytest

from hicache.cache.controller import AckQueue, TransferOp
from hicache.config import EngineConfig, ParallelConfig
from hicache.debug.consensus_checker import RankDivergenceError
from hicache.engine.rank_worker import RankSpec, init_distributed
from hicache.parallel.consensus import Consensus
from tests.parallel.ranks import outcomes_of, report

TP, PP = 2, 2


def op(ident: int, done: bool) -> TransferOp:
    o = TransferOp("backup", lambda _: None, ident=ident)
    if done:
        o.done.set()
    return o


def divergence(agreement) -> str:
    """The message of the divergence the agreement found, or "ok"."""
    try:
        agreement()
    except RankDivergenceError as exc:
        return str(exc)
    return "ok"


def scenario(rank: int, consensus: Consensus) -> dict:
    out: dict = {}
    stage = rank // TP
    # 1. Five ops issued on every rank. Ready here: rank 0: 2, rank 1: 3, stage 1: all 5 on rank 2,
    #    none yet on rank 3 (its copies finish 0.3 s later, on another thread).
    queue = AckQueue()
    ready = {0: 2, 1: 3, 2: 5, 3: 0}[rank]
    ops = [op(i, i < ready) for i in range(5)]
    for o in ops:
        queue.push(o)
    if rank == 3:
        threading.Timer(0.3, lambda: [o.done.set() for o in ops]).start()
    (agreed,) = consensus.agree_min("transfer_acks", [queue.ready()])
    started = time.monotonic()
    consumed = queue.pop(agreed)
    out["agreed"] = agreed
    out["waited"] = time.monotonic() - started
    out["left"] = len(queue)
    out["left_ready"] = queue.ready()
    consensus.confirm("transfer_acks", [o.ident for o in consumed])
    # 2. Storage threads: MIN over all four ranks (rank 3 found the fewest pages).
    out["hit"] = consensus.agree_min_all("storage_hit_pages", [10 - rank])[0]
    # 3. An agreement that passes: every chain is equal.
    out["second"] = consensus.agree_min("transfer_acks", [queue.ready()])
    # 4. Rank 2 (stage 1) consumes something else; it is named at the next agreement.
    consensus.confirm("transfer_acks", [99 if rank == 2 else 1])
    out["third"] = divergence(lambda: consensus.agree_min("transfer_acks", [0]))
    if stage == 0:
        # 5. Rank 1 (a TP peer of the first stage) diverges: both first-stage ranks find out. (Later
        # stages would wait for a message that never comes; the engine's ranks would then all fail.)
        consensus.confirm("transfer_acks", [7 if rank == 1 else 1])
        out["fourth"] = divergence(lambda: consensus.agree_min("transfer_acks", [0]))
    consensus.flush()
    return out


def _rank(rank: int, init: str, results) -> None:
    cfg = EngineConfig(parallel=ParallelConfig(tp_size=TP, pp_size=PP, dist_timeout=30))
    pctx = init_distributed(RankSpec(rank, rank, TP * PP, init, 1, 30), cfg)
    report(rank, scenario(rank, Consensus(pctx)), pctx, results)


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict]:
    return outcomes_of(_rank, TP * PP)


@pytest.mark.slow
def test_first_stage_agrees_on_the_min_and_later_stages_follow(outcomes):
    assert [outcomes[r]["agreed"] for r in range(4)] == [2, 2, 2, 2]


@pytest.mark.slow
def test_a_later_stage_leaves_extra_acks_queued(outcomes):
    assert outcomes[2]["left"] == 3 and outcomes[2]["left_ready"] == 3  # ready, but not agreed on yet


def test_a_later_stage_waits_for_its_own_copies(outcomes):
    assert outcomes[3]["waited"] > 0.1  # its copies finished after stage 0's count arrived
    assert outcomes[3]["left"] == 3


def test_storage_agreement_is_the_min_over_every_rank(outcomes):
    assert {outcomes[r]["hit"] for r in range(4)} == {7}


def test_equal_histories_pass(outcomes):
    # rank 0 has no more ready ACKs (rank 2 has three): stage 0's MIN again decides for everyone
    assert {tuple(outcomes[r]["second"]) for r in range(4)} == {(0,)}


def test_a_stage_that_consumed_other_operations_is_named(outcomes):
    assert "pipeline stage 1 (rank 2, tp0of2_pp1of2)" in outcomes[2]["third"]
    assert "consumed different operations" in outcomes[2]["third"]
    assert [outcomes[r]["third"] for r in (0, 1, 3)] == ["ok", "ok", "ok"]


def test_tp_peers_that_diverge_both_find_out(outcomes):
    for rank in (0, 1):
        assert "TP ranks agreed on or consumed different operations" in outcomes[rank]["fourth"]
