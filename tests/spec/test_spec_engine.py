"""Speculative decoding never changes an answer, on every tier: greedy outputs with a draft equal the
target's alone with the cache off, token for token, with device, host and storage hits (after a restart
on the same store), for the packed and the sidecar draft; the acceptance after hits equals the cache-off
acceptance exactly; without the draft's restore (the negative control) the draft recomputes, and a store
without the draft's pages cuts hits to what both models have, the metrics saying so either way."""

from __future__ import annotations

import pytest

from hicache import Engine, SamplingParams
from hicache.cache.stats import PrefetchLoss
from hicache.config import DebugConfig, HiCacheConfig
from hicache.errors import UserError
from tests.conversations import run_turns
from tests.parallel.workload import tier_totals as hits
from tests.parallel.workload import tokens
from tests.spec.workload import (
    CONVS,
    DEVICE_TOKENS,
    NEW,
    TURNS,
    acceptance,
    assert_clean,
    every_tier_then_storage,
    spec,
    tiers,
)


@pytest.mark.slow
@pytest.mark.parametrize("draft,layout", [("tiny-draft-packed", "page_first"), ("tiny-draft-sidecar", "layer_first")])
def test_device_host_and_storage_hits_keep_outputs_and_acceptance(
    reference, cache_off_acceptance, tmp_path, draft, layout
):
    expected_layout = "packed" if draft == "tiny-draft-packed" else "sidecar"  # what auto chooses
    every_tier_then_storage(
        tiers(tmp_path, hicache_mem_layout=layout), draft, expected_layout, reference, cache_off_acceptance
    )


@pytest.mark.slow
def test_without_the_drafts_restore_the_draft_recomputes_and_outputs_stay(reference, cache_off_acceptance, tmp_path):
    draft = "tiny-draft-sidecar"
    debug = DebugConfig(debug_skip_draft_restore=True)
    cfg = tiers(tmp_path)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, speculative=spec(draft), debug=debug) as e:
        turns = run_turns(e, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        restored = hits(turns)["host"] + hits(turns)["storage"]
        assert restored > 0
        # The cache never claims draft state it did not restore: the draft recomputes exactly that
        # prefix (the metric says which of the two happened), so its proposals are those of cache off.
        assert e.spec_stats().draft_recomputed_tokens == restored
        assert acceptance(turns) == cache_off_acceptance[draft]
        assert_clean(e)


@pytest.mark.slow
def test_a_store_without_the_drafts_pages_cuts_the_hit(reference, cache_off_acceptance, tmp_path):
    cfg = tiers(tmp_path)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg) as engine:  # written without a draft
        assert tokens(run_turns(engine, CONVS, TURNS, NEW)) == reference
    draft = "tiny-draft-packed"
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, speculative=spec(draft)) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        assert acceptance(turns) == cache_off_acceptance[draft]
        # Every stored page lacks its draft part: no storage hit is used, and each cut page is counted.
        assert hits(turns)["storage"] == 0
        stats = engine.cache_stats().storage
        assert stats.prefetch.lost[PrefetchLoss.DRAFT_MISSING] > 0
        assert engine.spec_stats().draft_recomputed_tokens == 0
        assert_clean(engine)
    # Written by the speculative run, the draft's pages are there now; the target's were never rewritten.
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, speculative=spec(draft)) as engine:
        turns = run_turns(engine, CONVS, 1, NEW)
        assert hits(turns)["storage"] > 0


def test_sampling_requests_and_stops_inside_an_accepted_run():
    """A sampling request is not speculated and samples as without a draft. A stop token the target
    emits mid-run ends the request there: later accepted tokens are dropped, and only KV up to the
    sequence's end is shared (the leak check after a flush)."""
    history = list(CONVS[0]["system"])
    sampled = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7)
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        full = engine.generate([history], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0].token_ids
        stopping = SamplingParams(max_new_tokens=NEW, stop_token_ids=(full[NEW // 2],))
        want = engine.generate([history], stopping)[0].token_ids
        plain = engine.generate([history], sampled)[0].token_ids
    assert want[-1] == full[NEW // 2] and len(want) < NEW
    with Engine(model="tiny", speculative=spec("tiny-draft-packed")) as engine:
        assert [r.token_ids for r in engine.generate([history, history], stopping)] == [want, want]
        result = engine.generate([history], sampled)[0]
        assert result.token_ids == plain and result.spec_tokens == (0, 0)
        assert_clean(engine)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"speculative": spec("tiny-draft-sidecar"), "hicache": HiCacheConfig(hicache_draft_layout="packed")},
         "--hicache-draft-layout packed: the draft's row shape"),
        ({"speculative": spec("tiny-draft-nope")}, "unknown model"),
    ],
)  # fmt: skip
def test_bad_drafts_are_refused_at_start_up(kw, message):
    with pytest.raises(UserError, match=message):
        Engine(**{"model": "tiny", **kw})
