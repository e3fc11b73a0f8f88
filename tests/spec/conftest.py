"""References every speculative test compares with, computed once per session (each is several engine
runs): the target's greedy tokens with the cache off on one rank, and each draft's acceptance there."""

from __future__ import annotations

import pytest

from hicache import Engine
from tests.conversations import run_turns
from tests.parallel.workload import tokens
from tests.spec.workload import CONVS, DRAFTS, NEW, TURNS, acceptance, spec


@pytest.fixture(scope="session")
def reference():
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        return tokens(run_turns(engine, CONVS, TURNS, NEW))


@pytest.fixture(scope="session")
def cache_off_acceptance(reference):
    """Per draft: (proposed, accepted) with the cache off; its outputs are the target's alone."""
    out = {}
    for draft in DRAFTS:
        with Engine(model="tiny", disable_radix_cache=True, speculative=spec(draft)) as engine:
            turns = run_turns(engine, CONVS, TURNS, NEW)
            assert tokens(turns) == reference, f"{draft}, cache off: speculation changed the output"
            out[draft] = acceptance(turns)
            assert out[draft][1] > 0, f"{draft}: no proposal was ever accepted"
    return out
