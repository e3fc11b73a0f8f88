"""Control commands (docs/DESIGN.md, "engine") the engine front runs on the scheduler between two steps,
declared once: what each rank answers (`run`) and how the ranks' answers in rank order become one
(`combine`, given each rank's tp/pp/cp name). A command travels to the ranks by its name, so with
several ranks the same command is broadcast and the answers gathered; at one rank the scheduler's
answer is combined alone, so every caller sees the same shape of answer at any rank count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

from hicache.disagg import roles
from hicache.engine.snapshot import RankSnapshot, Snapshot, take_snapshot
from hicache.scheduler.scheduler import Scheduler

A = TypeVar("A")  # one rank's answer
T = TypeVar("T")  # the combined answer


@dataclass(frozen=True)
class Command(Generic[A, T]):
    name: str
    run: Callable[[Scheduler], A]
    combine: Callable[[Sequence[A], Sequence[str]], T]


def _first(answers: Sequence[A], names: Sequence[str]) -> A:
    return answers[0]


def _all_flushed(answers: Sequence[bool], names: Sequence[str]) -> bool:
    return all(answers)  # every rank refuses or accepts alike; a mix would itself be a divergence


def _named_problems(reports: Sequence[list[str]], names: Sequence[str]) -> list[str]:
    return [f"{name}: {problem}" for name, problems in zip(names, reports) for problem in problems]


def _all_verified(checks: Sequence[dict], names: Sequence[str]) -> dict:
    """Every rank checked its own shard: the deployment is verified (and the same at every thread
    count) only if all of them are. One rank's report is the deployment's as it is."""
    if len(checks) == 1:
        return checks[0]
    return {
        "verified": all(c["verified"] for c in checks),
        "mechanisms": checks[0]["mechanisms"],
        "detail": "; ".join(f"{name}: {c['detail']}" for name, c in zip(names, checks) if c["detail"]),
        "thread_count_invariant": all(c["thread_count_invariant"] for c in checks),
    }


FLUSH: Command[bool, bool] = Command("flush", lambda s: s.flush(), _all_flushed)
LEAK_REPORT: Command[list[str], list[str]] = Command("leak_report", lambda s: s.leak_report(), _named_problems)
INVARIANCE: Command[dict, dict] = Command("invariance", lambda s: s.runner.model.invariance.to_json(), _all_verified)
# Rank 0's shard stands for the deployment; every rank checks its own per transfer.
DISAGG_INFO: Command[dict, dict] = Command("disagg_info", roles.info, _first)
SNAPSHOT: Command[RankSnapshot, Snapshot] = Command("snapshot", take_snapshot, Snapshot.combine)

COMMANDS: dict[str, Command[Any, Any]] = {c.name: c for c in (FLUSH, LEAK_REPORT, INVARIANCE, DISAGG_INFO, SNAPSHOT)}
