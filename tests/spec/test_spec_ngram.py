"""`--speculative-algorithm ngram` never changes an answer: greedy outputs with n-gram proposals equal the
target's alone with the cache off, token for token, with device, host and storage hits and on two pipeline
stages (each proposing from its own copy of the tokens), with the cache-off single-rank run's acceptance
exactly; a sampling request gets no proposals. On the real model a code file quoted back with an edit is
copied from the prompt, the proposals accepted."""

from __future__ import annotations

import pytest

from hicache import Engine, SamplingParams
from hicache.config import ParallelConfig, SpeculativeConfig
from tests.conversations import run_turns
from tests.parallel.workload import tier_totals as hits
from tests.parallel.workload import tokens
from tests.spec.workload import CONVS, DEVICE_TOKENS, NEW, TURNS, K, acceptance, assert_clean, tiers

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

NGRAM = SpeculativeConfig("ngram", None, K)


@pytest.fixture(scope="module")
def ngram_acceptance(reference) -> tuple[int, int]:
    """(proposed, accepted) with the cache off on one rank; its outputs are the target's alone."""
    with Engine(model="tiny", disable_radix_cache=True, speculative=NGRAM) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
    assert tokens(turns) == reference
    proposed, accepted = acceptance(turns)
    assert accepted > 0 and proposed > accepted  # rejected rows were rolled back, the outputs unchanged
    return proposed, accepted


def test_ngram_keeps_outputs_and_acceptance_on_every_tier_and_proposes_nothing_for_sampling(
    reference, ngram_acceptance, tmp_path
):
    cfg = tiers(tmp_path)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, speculative=NGRAM) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        assert hits(turns)["device"] > 0 and hits(turns)["host"] > 0
        assert acceptance(turns) == ngram_acceptance
        stats = engine.spec_stats()
        assert (stats.proposed_tokens, stats.accepted_tokens, stats.draft_recomputed_tokens) == (*ngram_acceptance, 0)
        sampled = SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=7)
        repeating = turns[-1][0].token_ids * 4  # every suffix recurs: a greedy request would get proposals
        assert engine.generate([repeating], sampled)[0].spec_tokens == (0, 0)
        assert_clean(engine)
    # A new engine on the same store: the first turn's prompts come back from storage.
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, speculative=NGRAM) as engine:
        turns = run_turns(engine, CONVS, 1, NEW)
        assert tokens(turns) == reference[:1]
        assert hits(turns)["storage"] > 0
        assert_clean(engine)


def test_two_pipeline_stages_propose_alike_and_keep_outputs_and_acceptance(reference, ngram_acceptance, tmp_path):
    # The first stage embeds the verify rows from its own proposals; the sampling rank's choices come back
    # under a digest of the batch and its proposals, so a stage that proposed otherwise would fail the step.
    parallel = ParallelConfig(pp_size=2)
    with Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=tiers(tmp_path), speculative=NGRAM,
                parallel=parallel) as engine:  # fmt: skip
        turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        assert hits(turns)["host"] > 0
        assert acceptance(turns) == ngram_acceptance
        assert_clean(engine)


CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
EDIT = f"Here is geometry.py:\n\n{CODE}\nAdd a function `volume(width, height, depth)` at the end and show the whole file.\n"


def test_smollm2_quoting_a_file_back_keeps_the_tokens_with_proposals_accepted(tmp_path):
    params = SamplingParams(max_new_tokens=32)
    with Engine(model="smollm2", max_total_tokens=1024, disable_radix_cache=True) as engine:
        prompt = engine.tokenizer.chat_template.render([{"role": "user", "content": EDIT}])
        reference = engine.generate([prompt], params)[0].token_ids
    with Engine(model="smollm2", max_total_tokens=1024, hicache=tiers(tmp_path), speculative=NGRAM) as engine:
        first = engine.generate([prompt], params)[0]
        assert engine.flush_cache()  # device and host: the prompt comes back from storage
        again = engine.generate([prompt], params)[0]
        assert first.token_ids == reference and again.token_ids == reference
        assert again.cached_tokens_by_tier["storage"] > 0
        assert first.spec_tokens[1] > 0  # accepted: lines of the file it writes out again
        assert again.spec_tokens == first.spec_tokens  # proposals are a function of the tokens alone
        assert_clean(engine)
