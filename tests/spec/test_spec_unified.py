"""Speculative decoding under --hicache-storage-key-scheme unified: the draft's pages are a part of
their own in the unified layout (its own namespace and grid, hicache/cache/stores.py), read and written
through the same part loop as the target's. After a restart on the same store, greedy outputs with a
packed or a sidecar draft equal the target's alone with the cache off, storage hits restore both models
(the acceptance equals cache off's exactly), and the target's objects are the ones a cache without a
draft reads; a store written without speculation cuts the hits (draft_missing), outputs unchanged.

The dtype is the engine's default, as in tests/spec/test_spec_engine.py: one rank, so no TP sums differ.
"""

from __future__ import annotations

import pytest

from hicache import Engine
from hicache.cache.stats import PrefetchLoss
from hicache.config import ParallelConfig
from tests.conversations import run_turns
from tests.parallel.workload import tier_totals as hits
from tests.parallel.workload import tokens
from tests.spec.workload import CONVS, DEVICE_TOKENS, NEW, TURNS, acceptance, assert_clean, spec, tiers

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


def unified(tmp_path):
    # tiny has 2 KV heads: the default head partition (1) makes two head groups, so a packed draft's
    # pool interleaves the target's and the draft's layers within each group (not one span a part).
    return tiers(tmp_path, hicache_storage_key_scheme="unified", hicache_storage_layer_partition=2)


def run(cfg, draft: str | None, turns: int = TURNS, parallel: ParallelConfig | None = None):
    kw = {"speculative": spec(draft)} if draft else {}
    engine = Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, parallel=parallel or ParallelConfig(),
                    **kw)  # fmt: skip
    with engine:
        out = run_turns(engine, CONVS, turns, NEW)
        stats, spec_stats = engine.cache_stats().storage, engine.spec_stats() if draft else None
        assert_clean(engine)
    return out, stats, spec_stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("draft", ["tiny-draft-packed", "tiny-draft-sidecar"])
def test_draft_pages_come_back_from_a_unified_store(reference, cache_off_acceptance, tmp_path, draft):
    cfg = unified(tmp_path)
    turns, stats, _ = run(cfg, draft)
    assert tokens(turns) == reference and acceptance(turns) == cache_off_acceptance[draft]
    assert stats.store.puts > 0
    # A new engine on the same store: the histories come back from storage, both models' objects.
    turns, stats, spec_stats = run(cfg, draft)
    assert tokens(turns) == reference
    assert hits(turns)["storage"] > 0
    assert acceptance(turns) == cache_off_acceptance[draft]
    assert stats.prefetch.lost[PrefetchLoss.DRAFT_MISSING] == 0 and stats.store.corrupt == 0
    assert stats.store.span_bytes_read > 0
    assert spec_stats.draft_recomputed_tokens == 0  # every storage hit restored the draft too
    # The target's objects are exactly those of a cache without a draft: one reads them, same outputs.
    turns, stats, _ = run(cfg, None, turns=1)
    assert tokens(turns) == reference[: len(tokens(turns))]
    assert hits(turns)["storage"] > 0 and stats.store.corrupt == 0


@pytest.mark.timeout(300)
def test_a_unified_store_without_the_drafts_pages_cuts_the_hit(reference, cache_off_acceptance, tmp_path):
    cfg = unified(tmp_path)
    turns, _, _ = run(cfg, None)  # written without a draft
    assert tokens(turns) == reference
    draft = "tiny-draft-packed"
    turns, stats, spec_stats = run(cfg, draft)
    assert tokens(turns) == reference
    assert acceptance(turns) == cache_off_acceptance[draft]
    # Every stored page lacks its draft part: no storage hit is used, and each cut page is counted.
    assert hits(turns)["storage"] == 0
    assert stats.prefetch.lost[PrefetchLoss.DRAFT_MISSING] > 0
    assert spec_stats.draft_recomputed_tokens == 0


# (writer, reader) topologies: the draft split over TP (its cells cut by heads), the draft whole on both
# pipeline stages (the first writes it, the second reads the same objects), and its pages sharded over CP
# like the target's (each written by its owner).
ACROSS = {"tp1-to-tp2-packed": (ParallelConfig(), ParallelConfig(tp_size=2), "tiny-draft-packed"),
          "pp2-to-tp1-sidecar": (ParallelConfig(pp_size=2), ParallelConfig(), "tiny-draft-sidecar"),
          "cp2-to-tp1-packed": (ParallelConfig(cp_size=2), ParallelConfig(), "tiny-draft-packed")}  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pair", ACROSS)
def test_a_unified_store_serves_the_draft_across_topologies(reference, cache_off_acceptance, tmp_path, pair):
    """The draft's part is named by cells of the whole draft, so a store written at one topology restores
    both models at another: storage hits, no page cut for a missing draft part, nothing recomputed."""
    writer, reader, draft = ACROSS[pair]
    cfg = unified(tmp_path)
    turns, stats, _ = run(cfg, draft, parallel=writer)
    assert tokens(turns) == reference and acceptance(turns) == cache_off_acceptance[draft]
    assert stats.store.puts > 0
    turns, stats, spec_stats = run(cfg, draft, parallel=reader)
    assert tokens(turns) == reference
    assert hits(turns)["storage"] > 0
    assert acceptance(turns) == cache_off_acceptance[draft]
    assert stats.prefetch.lost[PrefetchLoss.DRAFT_MISSING] == 0 and stats.store.corrupt == 0
    assert spec_stats.draft_recomputed_tokens == 0
