"""Restores: host -> device loads that `KVCache.reserve` issues for KV another process completes (a P/D
decode server, hicache/disagg/), each tied to the handles whose prefix needs it.

A restore is not one of admission's loads (failed_loads.py): no step waits for it, since no handle
reading its pages computes until the restore has landed (`complete` is refused before that), and its
failure is not degraded to a recompute but fails the handles that need it, and only those: the one
that issued it, and any handle reserved meanwhile whose prefix reaches into its pages (it matched them
as device pages). The book of who needs what changes only in `track`, `landed` and `leave`, calls
every rank makes in the same order, so every rank holds the same book; whether a copy has landed is
this rank's to see (`status`) and is agreed by the caller before `complete`, and inside `leave`.

A restore stays in the book until its last handle has left: while it is there, `admit` waits
(`blocks_admission`), because a plain admission could not tell it apart from a device hit. When its
last handle leaves and it failed on any rank, its device pages are taken back from the tree (the nodes
keep their host copies), so no later match reads pages that were never written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from hicache.cache.api import KVHandle, RestoreState, RestoreStatus
from hicache.cache.controller import TransferTimeout
from hicache.cache.failed_loads import FailedLoads, IssuedLoad, LoadLedger
from hicache.cache.radix import TreeNode
from hicache.parallel.consensus import Consensus


@dataclass(eq=False)
class Restore:
    load: IssuedLoad
    needed_by: set[int] = field(default_factory=set)  # rids of the handles whose prefix it fills


@dataclass
class Restores:
    """The restores in flight or not yet left by their handles; empty without a host tier."""

    ledger: LoadLedger | None = None
    consensus: Consensus | None = None
    book: list[Restore] = field(default_factory=list)
    needs: dict[int, list[Restore]] = field(default_factory=dict)  # rid -> the restores it waits for

    def track(self, handle: KVHandle, issued: IssuedLoad | None) -> None:
        """A handle was just reserved holding `handle.pages` of the tree's prefix (and of the load
        `issued` for it, if any): it needs every restore in the book whose pages it holds."""
        held = set(handle.pages)
        needed = [r for r in self.book if not held.isdisjoint(r.load.device_pages)]
        if issued is not None:
            assert self.ledger is not None, "a load was issued without a host tier"
            self.ledger.claim(issued)
            needed.append(Restore(issued))
            self.book.append(needed[-1])
        for restore in needed:
            restore.needed_by.add(handle.rid)
        if needed:
            self.needs[handle.rid] = needed

    def blocks_admission(self) -> bool:
        return bool(self.book)

    def status(self, handle: KVHandle) -> RestoreStatus:
        needed = self.needs.get(handle.rid, [])
        for restore in needed:
            if restore.load.op.failed:
                return RestoreStatus(RestoreState.FAILED, str(restore.load.op.error))
        if any(not restore.load.landed() for restore in needed):
            return RestoreStatus(RestoreState.RUNNING)
        return RestoreStatus(RestoreState.LANDED)

    def landed(self, handle: KVHandle) -> None:
        """The handle completes: the caller agreed its restores landed on every rank."""
        if self.status(handle).state is not RestoreState.LANDED:
            raise RuntimeError(f"request {handle.rid}: completed before the restore of its prefix landed here")
        for restore in self._leave(handle):
            self._drop(restore)

    def leave(self, handle: KVHandle) -> FailedLoads:
        """The handle fails: of the restores it was the last to need, those that did not land on every
        rank (agreed here; a copy still running is waited for, bounded), for `take_back` once the handle
        has let go of their pages."""
        last = self._leave(handle)
        if not last:
            return FailedLoads()
        for restore in last:
            try:
                restore.load.op.wait()
            except TransferTimeout:
                restore.load.timed_out = True
        assert self.consensus is not None
        agreed = self.consensus.agree_min("restores_landed", [int(r.load.landed()) for r in last])
        for restore in last:
            self._drop(restore)
        return FailedLoads(tuple(r.load for r, ok in zip(last, agreed) if not ok))

    def take_back(self, failed: FailedLoads, detach: Callable[[list[TreeNode]], list[int]]) -> list[int]:
        """The device pages to free of restores that failed: `detach` takes them off their holders in the
        tree (radix.detach_device); a copy that never stopped keeps its own out of the pool (quarantine)."""
        if not failed:
            return []
        assert self.ledger is not None
        return self.ledger.hold_still_copying(failed, detach(failed.holders))

    def _leave(self, handle: KVHandle) -> list[Restore]:
        """Forget the handle's needs; the restores no handle needs any more."""
        last = []
        for restore in self.needs.pop(handle.rid, []):
            restore.needed_by.discard(handle.rid)
            if not restore.needed_by:
                last.append(restore)
        return last

    def _drop(self, restore: Restore) -> None:
        self.book.remove(restore)
        assert self.ledger is not None
        self.ledger.unclaim(restore.load)

    def leak_report(self) -> list[str]:
        return [f"{len(self.book)} restores still tracked"] if self.book else []
