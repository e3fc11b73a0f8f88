"""A prefill-decode pair in the capacity simulator (docs/DESIGN.md, "capacity simulator"): two simulated
servers, each with its own cache, tiers and clock, running the real P/D roles (hicache/disagg/:
`PrefillRole`, `DecodeRole`, so decode's admission, its `decode_prefix_len` from its own tree, its host
restore and prefill's sending are the engine's code) over a virtual KV link (kv_link.py).

Every request goes to both servers at its arrival with one bootstrap room, as `hicache router` sends
it. The two servers run in parallel in virtual time: the loop steps the server whose next action is
earliest (its clock, if it has work it can do; else its next copy, arrival or message), so each sees
the other's messages at the time they reach it. The client's view is decode's: the time to first token
is when decode starts decoding (prefill's first token, after the suffix landed and decode's own prefix
restored), the cached tokens are prefill's, and `transferred_tokens` the prompt less decode's prefix.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from math import inf

from hicache.bench.metrics import IdealCache, RequestRecord
from hicache.config import EngineConfig
from hicache.disagg.decode_role import DecodeRole
from hicache.disagg.handshake import Handshake
from hicache.disagg.prefill_role import PrefillRole
from hicache.mem.device_pool import DeviceKVPool
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.request import Bootstrap, RequestEvent
from hicache.sim.cost import CostModel
from hicache.sim.kv_link import VirtualKVLink
from hicache.sim.links import VirtualClock
from hicache.sim.simulator import Simulator
from hicache.sim.trace import TraceRequest

BOOTSTRAP_HOST = "simulated"


def simulated_handshake(pool: DeviceKVPool) -> Handshake:
    """A simulated server's identity as a KV producer or consumer: one rank of the "simulated" model
    (verified: the simulator's answers are the trace's, whatever the batch). Both servers' must match,
    so pairs the real handshake refuses (another page size) are refused here too."""
    return Handshake(
        model="simulated", dtype=str(pool.dtype).removeprefix("torch."), page_size=pool.page_size, tp_size=1,
        tp_rank=0, pp_size=1, pp_rank=0, layers=(0, pool.num_layers), num_layers=pool.num_layers, num_kv_heads=1,
        latent=False, kv_layout=tuple((c.name, tuple(c.shape)) for c in pool.layout.components), verified=True,
        mechanisms=(),
    )  # fmt: skip


def _in_role(cfg: EngineConfig, mode: str) -> EngineConfig:
    return dataclasses.replace(cfg, disagg=dataclasses.replace(cfg.disagg, disaggregation_mode=mode))


@dataclasses.dataclass
class _Pair:
    """One request's two halves and its client record."""

    trace: TraceRequest
    record: RequestRecord
    prompt: list[int]
    decode_prefix_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)


class PDSimulator:
    """A prefill server of `prefill_cfg` and a decode server of `decode_cfg` (each given its
    `--disaggregation-mode` here, which decides whether decode keeps a tree), costed by `cost` (its `[nic]`
    for the KV transfer)."""

    def __init__(
        self, prefill_cfg: EngineConfig, decode_cfg: EngineConfig, cost: CostModel, label: str = "simulated P/D"
    ) -> None:
        prefill_cfg, decode_cfg = _in_role(prefill_cfg, "prefill"), _in_role(decode_cfg, "decode")
        self.label = label
        clocks = VirtualClock(), VirtualClock()
        self.kv_link = VirtualKVLink(cost.nic, cost.kv_bytes_per_token, *clocks)
        pctx = ParallelContext()
        bootstrap = (BOOTSTRAP_HOST, 0)
        self.prefill = Simulator(prefill_cfg, cost, f"{label} prefill", clocks[0], role=lambda pool: PrefillRole(
            self.kv_link.prefill, pctx, simulated_handshake(pool), bootstrap))  # fmt: skip
        self.decode = Simulator(decode_cfg, cost, f"{label} decode", clocks[1], role=lambda pool: DecodeRole(
            self.kv_link.decode, pctx, simulated_handshake(pool)))  # fmt: skip
        # Each request's tokens of decode's own prefix, by tier (decode's `DisaggUsage`), in arrival order
        self.decode_prefixes: list[dict[str, int]] = []
        self._rooms = 0

    @property
    def servers(self) -> tuple[Simulator, Simulator]:
        return self.prefill, self.decode

    def run(self, trace: list[TraceRequest]) -> list[RequestRecord]:
        """Every request of `trace` to its end (decode's); one record each, in arrival order."""
        follower = {(t.conv_id, t.round): i for i, t in enumerate(trace) if t.after_previous}
        arrivals = [(t.arrival_s, i) for i, t in enumerate(trace) if not t.after_previous]
        heapq.heapify(arrivals)
        # Each server's requests not yet handed to it: (arrival time, room, request)
        inbox: dict[Simulator, list[tuple[float, int, _Pair]]] = {s: [] for s in self.servers}
        waiting = {s: False for s in self.servers}  # its last step did nothing: it waits for an event
        by_rid: dict[tuple[Simulator, int], _Pair] = {}
        records: list[RequestRecord] = []
        ideal = IdealCache()
        while arrivals or any(inbox.values()) or any(s.scheduler.has_work for s in self.servers):
            ready = {s: self._next_action(s, inbox[s], waiting[s]) for s in self.servers}
            server = min(self.servers, key=ready.get)  # type: ignore[arg-type]
            if arrivals and arrivals[0][0] <= ready[server]:
                when, i = heapq.heappop(arrivals)
                pair = _Pair(trace[i], RequestRecord(self.label, trace[i].conv_id, trace[i].group, trace[i].round,
                                                     when, 0, 0), trace[i].prompt())  # fmt: skip
                pair.record.prompt_tokens = pair.record.prompt_tokens_client = len(pair.prompt)
                pair.record.ideal_cached_tokens = ideal.on_send(pair.prompt)
                records.append(pair.record)
                self.decode_prefixes.append(pair.decode_prefix_by_tier)
                self._rooms += 1
                for s in self.servers:
                    inbox[s].append((when, self._rooms, pair))
                continue
            if ready[server] == inf:
                raise RuntimeError("the P/D simulator stalled: requests wait and nothing is in flight or to arrive")
            server.clock.advance_to(ready[server])
            for when, room, pair in [entry for entry in inbox[server] if entry[0] <= server.clock.now]:
                inbox[server].remove((when, room, pair))
                request = server.submit(list(pair.prompt), pair.trace.output_ids, Bootstrap(BOOTSTRAP_HOST, 0, room))
                by_rid[server, request.rid] = pair
            for link in server.links.values():
                link.run_until(server.clock.now)
            steps = server.compute.steps
            events = server.scheduler.step()
            for event in events:
                self._on_event(server, by_rid, event, ideal, follower, trace, arrivals)
            server.sample_occupancy()
            waiting[server] = server.compute.steps == steps and not events
        for server in self.servers:
            for link in server.links.values():
                link.finish_all()
        return records

    def _next_action(self, server: Simulator, inbox: list, waiting: bool) -> float:
        """When `server` can next do something: now if it has work it can do, else at its next event."""
        if server.scheduler.has_work and not waiting:
            return server.clock.now
        side = "prefill" if server is self.prefill else "decode"
        times = [server.next_completion, self.kv_link.next_event(side)] + [when for when, _, _ in inbox]
        return max(min(times), server.clock.now)

    def _on_event(self, server: Simulator, by_rid: dict, event: RequestEvent, ideal: IdealCache, follower: dict,
                  trace: list[TraceRequest], arrivals: list) -> None:  # fmt: skip
        pair: _Pair = by_rid[server, event.rid]
        record, now = pair.record, server.clock.now
        if event.error is not None:
            record.error = record.error or f"{'prefill' if server is self.prefill else 'decode'}: {event.error}"
        if server is self.prefill:
            if event.finish_reason is not None:
                del by_rid[server, event.rid]
                server.compute.answers.pop(event.rid)
            return
        if event.disagg is not None:  # decode's first event: the client's first token
            record.ttft_s = now - record.send_time_s
            record.cached_tokens_by_tier = dict(event.cached_tokens_by_tier or {})
            record.cached_tokens = sum(record.cached_tokens_by_tier.values())
            record.transferred_tokens = event.disagg.transferred_tokens
            pair.decode_prefix_by_tier.update(event.disagg.decode_prefix_by_tier)
        record.output_tokens += len(event.new_token_ids)
        if event.finish_reason is None:
            return
        del by_rid[server, event.rid]
        record.latency_s = now - record.send_time_s
        ideal.on_finish(pair.prompt, pair.trace.output_ids[: record.output_tokens])
        server.compute.answers.pop(event.rid)
        after = follower.get((pair.trace.conv_id, pair.trace.round + 1))
        if after is not None:
            heapq.heappush(arrivals, (now + trace[after].arrival_s, after))

    @property
    def decode_prefix_by_tier(self) -> Counter[str]:
        """Tokens of decode's own prefix, by tier, over every request so far."""
        return sum((Counter(tiers) for tiers in self.decode_prefixes), Counter())

    def bytes_moved(self) -> dict[str, int]:
        moved = {f"prefill {link}": n for link, n in self.prefill.bytes_moved().items()}
        moved["prefill->decode (NIC)"] = self.kv_link.bytes_moved
        return moved | {f"decode {link}": n for link, n in self.decode.bytes_moved().items()}

    def shutdown(self) -> None:
        for server in self.servers:
            server.shutdown()
