"""Host -> device loads that fail or time out degrade to a recompute (docs/DESIGN.md, "A cache never
changes an answer"; issue 15).

A load runs layer by layer on the load worker while the step that needs it computes; each layer's
attention waits (bounded, --hicache-transfer-timeout) for that layer's copy. A copy that fails or does
not land in time leaves its device pages unfilled, so whatever read them in this step is wrong. The
step is not failed for it: the forward runs to its end (its other requests are unaffected, each row's
KV being its own), and then, on every rank at once:

1. `settle`: the loads issued since the last settle are judged landed or not (every layer's copy done
   here), and every rank agrees (MIN over all ranks, pipeline stages included, once the forward is
   over on every stage): a load that failed on any of them failed on all, since pages split over TP,
   sharded over CP or cut into layer ranges over PP are only whole when every rank's part landed. A
   later stage's failed load therefore degrades like the first stage's: the forward goes on over its
   unfilled pages, and the step's output for the requests reading them is dropped.
2. the scheduler sends every request holding a failed load's page back to waiting, its output of the
   step dropped, to be admitted again without loading its host part (it recomputes from the last good
   page: the device prefix before the failed load);
3. `FailedLoads` is dropped by the cache: the nodes the loads gave device pages lose them again (host-
   only, their host copies intact), deepest first with their device-resident descendants, so no later
   match reads pages that were never written. Those nodes include the upper parts a later match of the
   step split off them, and the descendants include the nodes of loads that landed below them (a
   request of the same step continuing the same prefix): every page taken goes back to the pool. Pages
   of a load still running (timed out) cannot be reused until its copy stops writing into them: they
   are quarantined until the load's completion is acknowledged by every rank, then freed.

Counted: `load_failed_pages` and `load_timed_out_pages` (HostStats), and the requests recomputed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hicache.cache.controller import TransferOp
from hicache.cache.radix import TreeNode
from hicache.parallel.consensus import Consensus


@dataclass(eq=False)
class IssuedLoad:
    """One load-back in flight: its op, one event per layer, and the nodes and device pages it fills."""

    op: TransferOp
    layer_done: list[threading.Event]
    nodes: tuple[TreeNode, ...]
    device_pages: list[int]
    timed_out: bool = False  # a layer's wait gave up on it (this rank)

    def landed(self) -> bool:
        """Every layer's copy finished here (the op's own completion may trail its last layer)."""
        return not self.timed_out and not self.op.failed and all(e.is_set() for e in self.layer_done)

    def holders(self) -> list[TreeNode]:
        """The nodes its pages are on now: those it filled, and the upper parts a match split off them
        since (a split puts a new node above the one recorded, holding its first pages)."""
        pages = set(self.device_pages)
        holders = {node.id: node for node in self.nodes}
        for node in self.nodes:
            above = node.parent
            while (
                above is not None and above.id not in holders  # a node recorded walks up by itself
                and above.device_pages and pages.issuperset(above.device_pages)  # the root holds no page
            ):  # fmt: skip
                holders[above.id] = above
                above = above.parent
        return list(holders.values())


@dataclass(frozen=True)
class FailedLoads:
    """Loads every rank agreed did not land, in issue order."""

    loads: tuple[IssuedLoad, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads)

    @property
    def pages(self) -> frozenset[int]:
        return frozenset(p for load in self.loads for p in load.device_pages)

    @property
    def holders(self) -> list[TreeNode]:
        return [node for load in self.loads for node in load.holders()]


@dataclass
class LoadLedger:
    """The loads issued and not yet judged (the same list on every rank: admission is agreed), and the
    failed loads whose copies may still be writing."""

    consensus: Consensus
    unsettled: list[IssuedLoad] = field(default_factory=list)
    quarantine: list[IssuedLoad] = field(default_factory=list)
    restoring: list[IssuedLoad] = field(default_factory=list)  # claimed by restores.py

    def issued(self, load: IssuedLoad) -> None:
        self.unsettled.append(load)

    def claim(self, load: IssuedLoad) -> None:
        """A restore (restores.py): judged by the handles that need it, not here, and waited for by no
        step (no handle reading its pages computes before it lands)."""
        self.unsettled.remove(load)
        self.restoring.append(load)

    def unclaim(self, load: IssuedLoad) -> None:
        """The restore's last handle left."""
        self.restoring.remove(load)

    def awaited(self, op: TransferOp) -> bool:
        """A step that reads device pages waits for this load's layers: it is neither a restore nor a
        failed load still copying into pages nobody reads any more."""
        return not any(load.op is op for load in self.restoring) and not self.held(op)

    def degradable(self, op: TransferOp) -> IssuedLoad | None:
        return next((load for load in self.unsettled if load.op is op), None)

    def held(self, op: TransferOp) -> bool:
        """A load judged failed that is still copying into pages nobody reads any more."""
        return any(load.op is op for load in self.quarantine)

    def settle(self) -> FailedLoads:
        """Judge the loads issued since the last settle, agreed over every rank (see the module doc)."""
        if not self.unsettled:
            return FailedLoads()
        loads, self.unsettled = self.unsettled, []
        agreed = self.consensus.agree_min_world("loads_landed", [int(load.landed()) for load in loads])
        failed = tuple(load for load, ok in zip(loads, agreed) if not ok)
        for load in failed:
            if load.op.error is None and load.op.done.is_set():  # landed here, failed elsewhere
                load.op.error = RuntimeError("the load failed on another rank")
        return FailedLoads(failed)

    def hold_still_copying(self, failed: FailedLoads, taken: list[int]) -> list[int]:
        """Of the device pages `taken` back from the failed loads' holders and the nodes below them,
        those to free now: a load still copying keeps its own out of the pool until its copy has
        stopped (`release`)."""
        taken_set, held = set(taken), set()
        for load in failed.loads:
            if not load.op.done.is_set():
                load.device_pages = [p for p in load.device_pages if p in taken_set]  # the rest stay with their nodes
                self.quarantine.append(load)
                held.update(load.device_pages)
        return [p for p in taken if p not in held]

    def release(self, finished: list[TransferOp] | None = None) -> list[int]:
        """Pages of quarantined loads whose ops are in `finished` (acknowledged everywhere; None: all,
        at a drain), to be freed now."""
        done = set(map(id, finished)) if finished is not None else None
        keep, pages = [], []
        for load in self.quarantine:
            if done is None or id(load.op) in done:
                pages.extend(load.device_pages)
            else:
                keep.append(load)
        self.quarantine = keep
        return pages

    @property
    def quarantined_pages(self) -> int:
        return sum(len(load.device_pages) for load in self.quarantine)
