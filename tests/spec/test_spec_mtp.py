"""The MTP-shaped draft (docs/DESIGN.md, "Speculative decoding: an MTP head"): `tiny-mtp` reads tiny's
last hidden states, kept beside its own KV. Greedy outputs with it equal the target's alone with the cache
off, token for token; served from device, host and storage hits (a restart on the same store) its
acceptance equals the cache-off run's with nothing recomputed (each cached position's hidden state comes
back with the head's KV), and the pages it stores hold the same bytes whether their tokens came as
accepted proposals or in a prompt; without the head's restore (the negative control) the rows it
stores change and the outputs do not. At TP2, PP2 and TP2xCP2: tests/spec/test_spec_topology.py."""

from __future__ import annotations

import pytest

from hicache import Engine, SamplingParams
from hicache.config import DebugConfig
from tests.conversations import run_turns
from tests.parallel.workload import tier_totals as hits
from tests.parallel.workload import tokens
from tests.spec import workload
from tests.spec.workload import CONVS, DEVICE_TOKENS, NEW, TURNS, assert_clean, spec, tiers

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

DRAFT = "tiny-mtp"
NEW_HERE = 48  # enough accepted proposals that rows made of the head's own hidden states would show


def test_hits_on_every_tier_keep_outputs_and_the_heads_acceptance(reference, cache_off_acceptance, tmp_path):
    # Its row carries the target's hidden state beside its KV: not the target's row, so a sidecar.
    workload.every_tier_then_storage(tiers(tmp_path), DRAFT, "sidecar", reference, cache_off_acceptance)


def test_without_the_heads_restore_the_rows_it_computes_change_and_outputs_stay(reference, tmp_path):
    """The negative control: skip the head's restore and its KV over a restored prefix is recomputed from
    hidden states that were never restored, so the rows it computes after that prefix (the pages it stores)
    differ from those of a run that restores; the target still verifies every token. (Its acceptance may
    or may not change: with tiny-mtp's random weights it accepts ~7 % of proposals, and in bf16 the totals
    came out equal; the stored rows are what the restoring tests compare, so they are what must move.)"""
    stored = {}
    for skip in (False, True):
        cfg = tiers(tmp_path / f"skip-{skip}")
        debug = DebugConfig(debug_skip_draft_restore=skip)
        with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, speculative=spec(DRAFT),
                    debug=debug) as e:  # fmt: skip
            turns = run_turns(e, CONVS, TURNS, NEW)
            assert tokens(turns) == reference  # the target verifies every token
            restored = hits(turns)["host"] + hits(turns)["storage"]
            assert restored > 0 and e.spec_stats().draft_recomputed_tokens == (restored if skip else 0)
            assert_clean(e)
        stored[skip] = stored_draft_pages(tmp_path / f"skip-{skip}" / "store")
    assert stored[False].keys() == stored[True].keys()
    assert any(stored[False][name] != stored[True][name] for name in stored[False])


def stored_draft_pages(store) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in store.rglob("*_draft")}


def test_a_tokens_head_row_is_the_same_whether_it_came_as_a_proposal_or_in_a_prompt(tmp_path):
    """The head's rows of accepted proposals are recomputed from the target's hidden states, so the pages
    a generation stores hold what a prompt of the same tokens stores, byte for byte: what a later hit
    restores is what the cache-off run computes. (Keeping the rows made from the head's own hidden
    states passes the acceptance test above on its workload, but changes these bytes.)"""
    prompts = [list(c["system"]) + [40 + i] * 30 for i, c in enumerate(CONVS[::2])]  # two system prompts
    with Engine(model="tiny", hicache=tiers(tmp_path / "generated"), speculative=spec(DRAFT)) as engine:
        results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_HERE, ignore_eos=True))
        assert sum(r.spec_tokens[1] for r in results) > 0  # some rows came from accepted proposals
    sequences = [p + r.token_ids for p, r in zip(prompts, results)]
    with Engine(model="tiny", hicache=tiers(tmp_path / "prompted"), speculative=spec(DRAFT)) as engine:
        # One token: the head computes a prompt whose first token is its last after the target's pass.
        engine.generate(sequences, SamplingParams(max_new_tokens=1))
    generated, prompted = stored_draft_pages(tmp_path / "generated"), stored_draft_pages(tmp_path / "prompted")
    assert len(generated) > len(prompts) * NEW_HERE // 16 and generated.keys() == prompted.keys()  # output pages too
    assert [name for name in generated if generated[name] != prompted[name]] == []
