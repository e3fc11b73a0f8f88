"""References every speculative test compares with, computed once per session (each is several engine
runs): the target's greedy tokens with the cache off on one rank, and each draft's acceptance there, over
the workload's turns and, for the Astron shape, over four."""

from __future__ import annotations

import pytest

from hicache import Engine
from tests.conversations import run_turns
from tests.parallel.workload import tokens
from tests.spec.workload import CONVS, NEW, TURNS, acceptance, spec

FOUR_TURNS = 4


def cache_off_tokens(turns: int) -> list:
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        return tokens(run_turns(engine, CONVS, turns, NEW))


@pytest.fixture(scope="session")
def reference():
    return cache_off_tokens(TURNS)


@pytest.fixture(scope="session")
def four_turn_reference():
    return cache_off_tokens(FOUR_TURNS)


class _CacheOffAcceptance(dict):
    """Per draft: (proposed, accepted) with the cache off over as many turns as `reference` has, computed
    the first time a test asks for that draft (a session running one draft's tests runs only its
    reference); its outputs are the target's."""

    def __init__(self, reference) -> None:
        super().__init__()
        self.reference = reference

    def __missing__(self, draft: str) -> tuple[int, int]:
        with Engine(model="tiny", disable_radix_cache=True, speculative=spec(draft)) as engine:
            turns = run_turns(engine, CONVS, len(self.reference), NEW)
        assert tokens(turns) == self.reference, f"{draft}, cache off: speculation changed the output"
        self[draft] = acceptance(turns)
        assert self[draft][1] > 0, f"{draft}: no proposal was ever accepted"
        return self[draft]


@pytest.fixture(scope="session")
def cache_off_acceptance(reference):
    return _CacheOffAcceptance(reference)


@pytest.fixture(scope="session")
def four_turn_acceptance(four_turn_reference):
    return _CacheOffAcceptance(four_turn_reference)
