"""Rank agreement's contract (docs/DESIGN.md, "rank agreement" and "debugging"): which calls must give equal
arguments and results on every rank, and the error raised when ranks are found to disagree.

Both sides of the contract import this module and nothing above it: the agreement code in parallel/
(consensus, pipeline) raises `RankDivergenceError`, the scheduler and cache mark their decisions with
`consensus_checked`, and the rank consensus checker (hicache/debug/consensus_checker.py) reads the
marks. Keeping the marks here, not in the checker, is what lets parallel/ stay below debug/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

SPEC_ATTR = "__consensus_check__"

F = TypeVar("F", bound=Callable[..., Any])


class RankDivergenceError(RuntimeError):
    """Ranks made different decisions at the same logical point: the engine cannot continue safely."""


@dataclass(frozen=True)
class CheckSpec:
    params: tuple[tuple[str, Any], ...]  # (label, selector) evaluated before the call
    results: tuple[tuple[str, Any], ...]  # (label, selector) evaluated after it; "result" is the return value


def _labelled(selectors: Sequence[str] | Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    if isinstance(selectors, Mapping):
        return tuple(selectors.items())
    return tuple((s, s) for s in selectors)


def consensus_checked(
    *, params: Sequence[str] | Mapping[str, Any] = (), results: Sequence[str] | Mapping[str, Any] = ("result",)
) -> Callable[[F], F]:
    """Marks a method whose selected arguments and results must agree across ranks.

    A selector is a dotted path into the call's namespace (its arguments by name, `self`, and after
    the call `result`), e.g. "req.rid" or "result", or a callable taking that namespace. A plain list
    labels each value by its path; a mapping gives labels. Arguments not selected are ignored. The mark
    is an attribute on the function, which is returned unchanged: an unchecked engine runs exactly the
    code it would run without the checker."""
    spec = CheckSpec(_labelled(params), _labelled(results))

    def mark(fn: F) -> F:
        setattr(fn, SPEC_ATTR, spec)
        return fn

    return mark
