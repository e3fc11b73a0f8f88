"""References every speculative test compares with, computed once per session (each is several engine
runs): the target's greedy tokens with the cache off on one rank, and each draft's acceptance there."""

from __future__ import annotations

import pytest

from hicache import Engine
from tests.conversations import run_turns
from tests.parallel.workload import tokens
from tests.spec.workload import CONVS, NEW, TURNS, acceptance, spec


@pytest.fixture(scope="session")
def reference():
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        return tokens(run_turns(engine, CONVS, TURNS, NEW))


class _CacheOffAcceptance(dict):
    """Per draft: (proposed, accepted) with the cache off, computed the first time a test asks for that
    draft (a session running one draft's tests runs only its reference); its outputs are the target's."""

    def __init__(self, reference) -> None:
        super().__init__()
        self.reference = reference

    def __missing__(self, draft: str) -> tuple[int, int]:
        with Engine(model="tiny", disable_radix_cache=True, speculative=spec(draft)) as engine:
            turns = run_turns(engine, CONVS, TURNS, NEW)
        assert tokens(turns) == self.reference, f"{draft}, cache off: speculation changed the output"
        self[draft] = acceptance(turns)
        assert self[draft][1] > 0, f"{draft}: no proposal was ever accepted"
        return self[draft]


@pytest.fixture(scope="session")
def cache_off_acceptance(reference):
    return _CacheOffAcceptance(reference)
