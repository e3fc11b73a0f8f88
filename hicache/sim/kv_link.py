"""A P/D pair's KV transfer in virtual time (docs/DESIGN.md, "capacity simulator"): the transfer backend
(hicache/disagg/transfer.py) the real `PrefillRole` and `DecodeRole` run over in the simulator, in place
of ZeroMQ or RDMA.

Each server keeps its own clock (hicache/sim/pd.py steps the one behind), so every message carries the
time it reaches the other side, and a side sees it only once its own clock has passed that time: decode's
metadata (`decode_prefix_len`) reaches prefill `latency_s` after decode's `init`; the suffix prefill
hands `send` as its request ends crosses the NIC, one FIFO link of the cost model's `[nic]`, and has
landed `latency_s + bytes / bandwidth` after the link frees (bytes: the suffix's tokens x the modelled
KV's bytes a token), when decode's receiver says SUCCESS and prefill's stops `reading` (its pages go
back to its cache). The bytes are costed, not copied: nothing reads the simulator's pools' values (the
answers are the trace's). The transfer is whole, after prefill's last step, as the real one starts
then too; its chunking is not modelled. No transfer times out or fails unless a side aborts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf

import torch

from hicache.disagg.transfer import DecodeMetadata, KVPoll, KVSource, PrefillResult
from hicache.scheduler.request import Bootstrap
from hicache.sim.cost import Link
from hicache.sim.links import VirtualClock


@dataclass(eq=False)
class _Room:
    """One request's transfer, shared by its sender and its receiver."""

    metadata: DecodeMetadata | None = None
    metadata_at: float = inf  # when decode's metadata reaches prefill
    result: PrefillResult | None = None
    landed_at: float = inf  # when the suffix has crossed
    failure: str | None = None


class VirtualKVLink:
    """The NIC between a simulated prefill server (`prefill_clock`) and a decode server (`decode_clock`):
    `prefill` and `decode` are the two sides' transfer backends."""

    def __init__(self, nic: Link, kv_bytes_per_token: int, prefill_clock: VirtualClock, decode_clock: VirtualClock):
        self.nic = nic
        self.kv_bytes_per_token = kv_bytes_per_token
        self.clocks = {"prefill": prefill_clock, "decode": decode_clock}
        self.rooms: dict[int, _Room] = {}
        self.bytes_moved = 0
        self._free_at = 0.0
        self.prefill = _Side(self, "prefill")
        self.decode = _Side(self, "decode")

    def room(self, bootstrap: Bootstrap) -> _Room:
        return self.rooms.setdefault(bootstrap.room, _Room())

    def carry(self, room: _Room, tokens: int) -> None:
        """The suffix of `tokens` onto the NIC, sent at prefill's time."""
        nbytes = tokens * self.kv_bytes_per_token
        self.bytes_moved += nbytes
        start = max(self._free_at, self.clocks["prefill"].now)
        self._free_at = start + self.nic.latency_s + nbytes / self.nic.bandwidth
        room.landed_at = self._free_at

    def next_event(self, side: str) -> float:
        """When the next message reaches `side` (infinity: none is on its way); forgets the transfers both
        sides have seen end."""
        now = self.clocks[side].now
        seen_by_both = min(clock.now for clock in self.clocks.values())
        self.rooms = {k: r for k, r in self.rooms.items() if r.failure is None and r.landed_at > seen_by_both}
        times = [r.landed_at for r in self.rooms.values() if r.landed_at > now]
        if side == "prefill":
            times += [r.metadata_at for r in self.rooms.values() if r.result is None and r.metadata_at > now]
        return min(times, default=inf)


class _Side:
    """One side's `KVTransferBackend`."""

    def __init__(self, link: VirtualKVLink, name: str) -> None:
        self.link = link
        self.clock = link.clocks[name]

    def sender(self, bootstrap: Bootstrap, prompt_len: int) -> VirtualSender:
        return VirtualSender(bootstrap.room, self.link, self.link.room(bootstrap), self.clock)

    def receiver(self, bootstrap: Bootstrap) -> VirtualReceiver:
        return VirtualReceiver(bootstrap.room, self.link, self.link.room(bootstrap), self.clock)

    @property
    def moved_bytes(self) -> int:
        return self.link.bytes_moved

    @property
    def peak_staged_bytes(self) -> int:
        return 0  # nothing is staged: the bytes are costed, not copied

    def shutdown(self) -> None:
        for room in self.link.rooms.values():
            room.failure = room.failure or "the simulation ended"


class _End:
    def __init__(self, room: int, link: VirtualKVLink, state: _Room, clock: VirtualClock) -> None:
        self.room = room
        self.link = link
        self.state = state
        self.clock = clock

    def abort(self, reason: str) -> None:
        self.state.failure = self.state.failure or reason

    def failure(self) -> str | None:
        return self.state.failure

    @property
    def landed(self) -> bool:
        return self.clock.now >= self.state.landed_at


class VirtualSender(_End):
    def poll(self) -> KVPoll:
        s = self.state
        if s.failure is not None:
            return KVPoll.FAILED
        if s.metadata is None or self.clock.now < s.metadata_at:
            return KVPoll.BOOTSTRAPPING
        if s.result is None:
            return KVPoll.WAITING_FOR_INPUT
        return KVPoll.SUCCESS if self.landed else KVPoll.TRANSFERRING

    def metadata(self) -> DecodeMetadata | None:
        return self.state.metadata if self.poll() >= KVPoll.WAITING_FOR_INPUT else None

    def working(self) -> None:
        """Nothing to say: no transfer times out in the simulator."""

    def send(self, kv: KVSource, result: PrefillResult) -> None:
        self.state.result = result
        self.link.carry(self.state, kv.end - kv.start)

    @property
    def reading(self) -> bool:
        return self.state.failure is None and self.state.result is not None and not self.landed


class VirtualReceiver(_End):
    def init(self, slots: torch.Tensor, metadata: DecodeMetadata) -> None:
        self.state.metadata = metadata
        self.state.metadata_at = self.clock.now + self.link.nic.latency_s

    def poll(self) -> KVPoll:
        s = self.state
        if s.failure is not None:
            return KVPoll.FAILED
        if s.metadata is None:
            return KVPoll.BOOTSTRAPPING
        if s.result is None or not self.landed:
            return KVPoll.TRANSFERRING if s.result is not None else KVPoll.WAITING_FOR_INPUT
        return KVPoll.SUCCESS

    def result(self) -> PrefillResult | None:
        return self.state.result if self.poll() is KVPoll.SUCCESS else None
