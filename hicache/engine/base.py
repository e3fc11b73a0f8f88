"""The runtime protocol (docs/DESIGN.md, "engine"): what `Engine` needs from whatever runs the schedulers,
whether one scheduler on a thread of this process (`local.LocalRuntime`) or one per rank process in
lockstep (`rank_front.RankRuntime`). Events flow the other way, through the `dispatch` callback each
runtime is given when it starts.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from hicache.engine.commands import Command
from hicache.scheduler.request import Request

A = TypeVar("A")
T = TypeVar("T")


class Runtime(Protocol):
    def submit(self, req: Request) -> None:
        """Queue `req` for the scheduler(s); raises RuntimeError once the runtime failed or shut down."""

    def cancel(self, rid: int) -> None:
        """Abort request `rid` at the next step if it is still running (a no-op otherwise)."""

    def control(self, command: Command[A, T]) -> T:
        """Run a command (engine/commands.py) between two steps on every rank; one combined answer."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running, including those not yet taken by a scheduler."""

    def shutdown(self) -> None:
        """Abort what is in flight (each request gets its final event), stop, release the cache; idempotent."""


def check_usable(failure: str | None, stopped: bool) -> None:
    """Refuse new work once the engine failed (with the first line of why) or was shut down. The one
    wording of both refusals, for the engine front and the runtimes under it."""
    if failure is not None:
        raise RuntimeError(f"the engine failed: {failure.splitlines()[0]}")
    if stopped:
        raise RuntimeError("the engine is shut down")
