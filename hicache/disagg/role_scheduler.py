"""P/D disaggregation: what the prefill and decode schedulers share on top of the plain `Scheduler` —
this rank's transfer backend, its place among the ranks (transfer outcomes are agreed over them),
its handshake, and its role's counters; closing the scheduler closes the transport."""

from __future__ import annotations

from typing import Any

from hicache.disagg.handshake import Handshake
from hicache.disagg.stats import DisaggStats
from hicache.disagg.transfer import KVTransferBackend
from hicache.engine.scheduler import Scheduler
from hicache.parallel.parallel import ParallelContext


class RoleScheduler(Scheduler):
    role = ""

    def __init__(
        self, *args: Any, transfer: KVTransferBackend, pctx: ParallelContext, handshake: Handshake, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.transfer = transfer
        self.pctx = pctx
        self.handshake = handshake
        self.stats = DisaggStats(self.role)

    def close(self) -> None:
        self.transfer.shutdown()
