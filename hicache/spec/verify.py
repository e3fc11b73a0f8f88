"""Greedy verification (DESIGN.md, "speculative decoding": verify/accept).

The target scores the last known token and the K proposals in one (K+1)-row forward pass; row i's
logits are those a plain decode step would give after the first i proposals (batch invariance makes
the rows bitwise equal to K+1 separate decode steps). Its greedy choice g_i on row i is what plain
decoding would emit there, so the run of proposals equal to the target's choices (d_i == g_i for
i < a) is exactly what it would have emitted anyway, and g_a is its next token after them: greedy
output with speculation is the target's alone, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_length(proposed: Sequence[int], target: Sequence[int]) -> int:
    """How many leading proposals equal the target's own choices (`target[i]`: its choice after the
    first i proposals; one more than there are proposals)."""
    if len(target) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposals need {len(proposed) + 1} target choices, got {len(target)}")
    for i, token in enumerate(proposed):
        if token != target[i]:
            return i
    return len(proposed)


def emitted(proposed: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a verify step emits: the target's choices up to and including the first one that
    differs from a proposal (all K+1 when every proposal was accepted)."""
    return list(target[: accepted_length(proposed, target) + 1])
