"""Speculative decoding on several ranks (docs/DESIGN.md, "Speculative decoding on every topology"): at TP2
(the draft sharded like the target, so its host rows pack with the target's), at PP2 (the draft whole
on both stages, a sidecar), at CP2 (the draft's pages sharded like the target's) and at TP2xCP2 with an
MTP head (the seed's section 1.4 shape), with a
host and a storage tier, greedy outputs equal the single-rank cache-off target's token for token,
acceptance equals the single-rank speculative run's exactly, the draft's state comes back with every
host and storage hit, and the consensus checker finds every rank's acceptance equal (and, on the same
logs edited on one rank, names it). An MTP head runs at TP2 and at PP2 (every stage's copy reading the
target's hidden states the last stage sends back). The negative control skips the draft's restore:
outputs stay, the recompute counter shows what the restore saved, and the MTP head's acceptance changes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hicache import Engine
from hicache.cache.stats import PrefetchLoss
from hicache.cache.stores import part_store, unified_namespace
from hicache.config import DebugConfig, EngineConfig, HiCacheConfig, ParallelConfig
from hicache.debug.consensus_checker import ENV_ENABLE, ENV_LOG_DIR, check_logs, load_logs
from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_group import DRAFT_PART
from hicache.mem.host_pool import HostKVPool, PagePart, PartShard
from hicache.mem.kv_layout import KVLayout
from hicache.model.loading.draft import load_draft
from hicache.model.loading.loader import load_model
from hicache.parallel.parallel import ParallelContext
from hicache.spec.build import build_draft, draft_context
from hicache.storage import FileBackend, UnifiedStore
from hicache.storage.unified import KVGeometry, Shard
from tests.conversations import run_turns
from tests.parallel.workload import tier_totals as hits
from tests.parallel.workload import tokens
from tests.spec.workload import CONVS, DEVICE_TOKENS, NEW, TURNS, acceptance, assert_clean, spec, tiers

TOPOLOGIES = {"tp2-packed": (ParallelConfig(tp_size=2), "tiny-draft-packed"),
              "pp2-sidecar": (ParallelConfig(pp_size=2), "tiny-draft-sidecar"),
              "cp2-packed": (ParallelConfig(cp_size=2), "tiny-draft-packed"),
              # The seed's section 1.4 shape (TP4/CP4 + MTP + host cache) at the 4 processes CI has: the MTP
              # head's pages sharded like the target's, each row reading its predecessor from the owner.
              "tp2cp2-mtp": (ParallelConfig(tp_size=2, cp_size=2), "tiny-mtp"),
              "tp2-mtp": (ParallelConfig(tp_size=2), "tiny-mtp"),
              # The head on both stages, reading the target's hidden states the last stage sends back.
              "pp2-mtp": (ParallelConfig(pp_size=2), "tiny-mtp")}  # fmt: skip
ACCEPT = "SpeculativeDecoder.accept"


def speculative_engine(tmp_path, parallel: ParallelConfig, draft: str, debug: DebugConfig | None = None) -> Engine:
    # --max-total-tokens is a rank's pool: CP ranks together hold cp_size times it, so each gets a share.
    return Engine(model="tiny", max_total_tokens=DEVICE_TOKENS // parallel.cp_size, hicache=tiers(tmp_path),
                  speculative=spec(draft), parallel=parallel, debug=debug or DebugConfig())  # fmt: skip


def accept_entries(log_dir) -> dict[int, list[dict]]:
    logs, _ = load_logs(log_dir)
    return {rank: [e for e in entries if e["call"] == ACCEPT] for rank, entries in logs.items()}


def keep_one_fewer(log) -> None:
    """Edit a rank's log: its first verify step with proposals kept one token fewer."""
    lines = log.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if ACCEPT in line and '"proposals": [[' in line)
    entry = json.loads(lines[at])
    entry["result"]["kept"][0][0] -= 1
    lines[at] = json.dumps(entry, sort_keys=True)
    log.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_speculation_on_several_ranks_equals_one_rank(
    reference, cache_off_acceptance, tmp_path, monkeypatch, topology
):
    parallel, draft = TOPOLOGIES[topology]
    monkeypatch.setenv(ENV_ENABLE, "1")
    monkeypatch.setenv(ENV_LOG_DIR, str(tmp_path / "logs"))
    with speculative_engine(tmp_path, parallel, draft) as engine:
        monkeypatch.delenv(ENV_ENABLE)  # the ranks read it when they started
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        assert hits(turns)["device"] > 0 and hits(turns)["host"] > 0
        assert acceptance(turns) == cache_off_acceptance[draft]
        # From storage alone: the first turn again, after the memory tiers are emptied.
        assert engine.flush_cache()
        again = run_turns(engine, CONVS, 1, NEW)
        assert tokens(again) == reference[:1]
        assert hits(again)["storage"] > 0
        assert acceptance(again) == acceptance(turns[:1])  # restored draft state proposes as computed did
        assert engine.cache_stats().storage.prefetch.lost[PrefetchLoss.DRAFT_MISSING] == 0
        assert engine.spec_stats().draft_recomputed_tokens == 0  # every hit restored the draft's state too
        assert_clean(engine)
    agreed, summary = check_logs(tmp_path / "logs")
    assert agreed, summary
    entries = accept_entries(tmp_path / "logs")
    assert sorted(entries) == list(range(parallel.world_size))
    assert all(e == entries[0] for e in entries.values()) and any(e["params"]["proposals"] for e in entries[0])
    # The check can fail: the same logs with one token fewer kept on rank 1 at one verify step.
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "logs", edited)
    keep_one_fewer(edited / "rank1.jsonl")
    agreed, summary = check_logs(edited)
    assert not agreed and ACCEPT in summary and "rank(s) 1 differ from rank 0" in summary


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("topology", ["pp2-sidecar", "pp2-mtp"])
def test_without_the_drafts_restore_the_draft_recomputes_on_every_stage(
    reference, cache_off_acceptance, tmp_path, topology
):
    """The negative control at PP2: loads restore the target's state only. Answers do not change, but the
    counter the test above holds at 0 counts exactly the restored prefix. The separate draft recomputes
    what it lacks from the tokens, so its acceptance stays; the MTP head's changes, since the target's
    hidden states it reads over that prefix were never restored."""
    parallel, draft = TOPOLOGIES[topology]
    with speculative_engine(tmp_path, parallel, draft, DebugConfig(debug_skip_draft_restore=True)) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        recomputes_from_tokens = draft != "tiny-mtp"
        assert (acceptance(turns) == cache_off_acceptance[draft]) == recomputes_from_tokens
        assert hits(turns)["host"] > 0
        assert engine.spec_stats().draft_recomputed_tokens == hits(turns)["host"] + hits(turns)["storage"]
        assert_clean(engine)


def test_a_target_with_page_sharded_kv_is_refused():
    """An MLA target at TP2 shards its pages over the TP ranks (here rank 0's pool of such pages); the
    draft's pool, indexed by the same pages, does not shard that way."""
    pool = DeviceKVPool(KVLayout.mha(2, 32), 1, 8, 16, torch.float32, torch.device("cpu"), shards=2, shard_rank=0)
    with pytest.raises(UserError, match="sharded over 2 ranks and the draft's over 1"):
        cfg = EngineConfig(speculative=spec("tiny-draft-packed"))
        build_draft(cfg, load_model("tiny-mla"), pool, ParallelContext())


def test_a_draft_with_per_token_state_is_refused_under_cp():
    pool = DeviceKVPool(KVLayout.mha(2, 32), 1, 8, 16, torch.float32, torch.device("cpu"), shards=2, shard_rank=0)
    cfg = EngineConfig(speculative=spec("tiny-draft-sidecar"), parallel=ParallelConfig(cp_size=2))
    with pytest.raises(UserError, match="tiny-draft-sidecar keeps per-token state .* --cp-size > 1"):
        build_draft(cfg, load_model("tiny"), pool, ParallelContext(cp_size=2))


def test_the_draft_runs_on_its_stage_sharded_like_the_target_or_whole():
    tiny = load_model("tiny")
    last_stage = ParallelContext(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1)
    stage = draft_context(last_stage, load_draft("tiny-draft-packed", tiny))
    assert (stage.tp_size, stage.tp_rank, stage.pp_size, stage.pp_rank) == (2, 1, 1, 0)
    assert stage.is_first_stage and stage.is_last_stage  # all of its layers, its logits on every rank
    # A draft whose KV would be page-sharded over TP (an MLA model) runs whole on each rank instead.
    whole = draft_context(ParallelContext(tp_size=2, tp_rank=1), load_draft("tiny-mla", tiny))
    assert whole == ParallelContext()


def test_a_draft_split_over_tp_whose_rows_are_not_heads_is_refused_under_unified_keys(tmp_path):
    """An MLA-like row (here: one latent row a token) split over TP has no head to cut its cells by."""
    draft = DeviceKVPool(KVLayout.mla(32, 16), 1, 8, 16, torch.float32, torch.device("cpu"))
    part = PagePart(DRAFT_PART, HostKVPool(draft, 8, "page_unified"), range(1), "some-draft", PartShard(range(1), 2))
    namespace = unified_namespace(HiCacheConfig(), KVGeometry(1, 2, 32), "tiny", "float32", 16)
    store = UnifiedStore(FileBackend(str(tmp_path)), namespace, Shard(range(1), range(1)), 4)
    with pytest.raises(UserError, match="some-draft's rows are not K/V heads alone and it is sharded over TP"):
        part_store(store, part)
