"""The capacity simulator's engine (docs/DESIGN.md, "capacity simulator"): the real scheduler and cache
on one-row pools, driven in virtual time.

Real: the scheduler (admission, chunked prefill, in-batch prefix waits, decode batching), the cache API
and everything under it (radix tree, eviction, write policies, load-back threshold, reservations, the
storage tier's prefetch and puts against the configured store). The pools are real too, one layer of
one-element rows, so their copies cost nothing and a stored page is a few bytes (under the namespace of
the "simulated" model, which no engine reads); what a step, a copy and a storage call cost is the cost
model's (cost.py), charged to a virtual clock. The model is replaced by `CostedCompute`, which answers
each request with its trace's output tokens.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from math import inf

import torch

from hicache.bench.metrics import IdealCache, RequestRecord
from hicache.cache import Worker, device_cache, hierarchical_cache
from hicache.config import EngineConfig, HiCacheConfig
from hicache.disagg.roles import radix_enabled
from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.parallel.consensus import Consensus
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.model_runner import StepOutput, WorkItem
from hicache.scheduler.request import Bootstrap, Request, SamplingParams
from hicache.scheduler.role import Role
from hicache.scheduler.scheduler import Scheduler, check_request_fits
from hicache.sim.cost import CostModel
from hicache.sim.links import StorageLink, VirtualClock, VirtualLink
from hicache.sim.trace import TraceRequest
from hicache.storage.codec import HEADER_SIZE

# What a simulated request may span: the trace's lengths are the limit, not a model's positions.
SIMULATED_CONTEXT = 2**40
# The tiers' workers, by name (hicache/cache/host_tier.py, storage_tier.py), and the links they run on.
LINK_OF_WORKER = {"backup": "device->host", "load": "host->device", "storage": "storage"}


def stored_bytes(hc: HiCacheConfig, pool: DeviceKVPool, page_bytes: int) -> int:
    """The cap, in the simulator's own stored bytes, that holds as many pages as `--hicache-storage-max-bytes`
    holds of the modelled KV (`page_bytes` a page): a store keeps each page in its verified envelope (a
    header, then the page) and evicts by those bytes, the simulator's one-row pages as the model's."""
    pages = hc.hicache_storage_max_bytes // (HEADER_SIZE + page_bytes)
    if pages < 1:
        raise UserError(f"--hicache-storage-max-bytes {hc.hicache_storage_max_bytes} holds no {page_bytes}-byte page")
    return pages * (HEADER_SIZE + pool.bytes_per_token * pool.page_size)


class CostedCompute:
    """A `StepCompute` that costs a step by the cost model and advances the clock by it. A step whose
    loads are still in flight ends no earlier than they do (the real forward pass waits layer by layer)."""

    speculative = False

    def __init__(self, cost: CostModel, clock: VirtualClock, load_link: VirtualLink | None) -> None:
        self.cost = cost
        self.clock = clock
        self.load_link = load_link
        self.answers: dict[int, tuple[int, ...]] = {}  # rid -> its trace's output tokens
        self.steps = 0

    def step(self, work: list[WorkItem], before_layer) -> list[StepOutput]:  # noqa: ANN001 - StepCompute's
        prefill = [(i.start, i.end) for i in work if i.start < i.req.prompt_len]
        decoding = [i.start for i in work if i.start >= i.req.prompt_len]
        end = self.clock.now + self.cost.step_s(prefill, decoding)
        if before_layer is not None and self.load_link is not None:
            end = max(end, self.load_link.finish_all())
        self.clock.advance_to(end)
        self.steps += 1
        return [StepOutput(i.end, i.end, [(self._next(i.req), None)] if i.needs_logits else []) for i in work]

    def _next(self, req: Request) -> int:
        return self.answers[req.rid][len(req.output_ids)]


@dataclasses.dataclass(frozen=True)
class PoolOnly:
    """What the scheduler's parts read of a model runner here: its pool (a P/D role reads and writes a
    request's rows there). There is no model: `CostedCompute` computes."""

    pool: DeviceKVPool


@dataclasses.dataclass
class _Live:
    trace: TraceRequest
    request: Request
    record: RequestRecord


class Simulator:
    """One simulated server. `clock`: its own virtual time (a P/D pair's two servers each keep theirs:
    hicache/sim/pd.py); `role`: its P/D role part, made from its pool (None: a server doing everything)."""

    def __init__(
        self, cfg: EngineConfig, cost: CostModel, label: str = "simulated", clock: VirtualClock | None = None,
        role: Callable[[DeviceKVPool], Role] | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.cost = cost
        self.label = label
        self.clock = clock if clock is not None else VirtualClock()
        page_bytes = cost.kv_bytes_per_token * cfg.page_size
        self.links = {
            "device->host": VirtualLink("device->host", self.clock, cost.device_to_host.bandwidth,
                                        cost.device_to_host.latency_s, page_bytes),
            "host->device": VirtualLink("host->device", self.clock, cost.host_to_device.bandwidth,
                                        cost.host_to_device.latency_s, page_bytes),
        }  # fmt: skip
        # CP ranks shard the pages (docs/DESIGN.md, "CP page sharding"): every rank keeps the same logical tree
        # and decides alike, so rank 0's pool, its owner classes and its tiers make every rank's decisions.
        pool = DeviceKVPool(KVLayout.mha(1, 1), 1, cfg.num_pages, cfg.page_size, torch.float32, torch.device("cpu"),
                            shards=cfg.parallel.cp_size, gather_pages=cfg.cp_gather_pages)  # fmt: skip
        hc = cfg.hicache
        if hc.enable_hierarchical_cache:
            if hc.hicache_storage_max_bytes:  # bytes of the modelled KV: the same pages of the simulator's
                hc = dataclasses.replace(hc, hicache_storage_max_bytes=stored_bytes(hc, pool, page_bytes))
            if hc.hicache_storage_backend:
                self.links["storage"] = StorageLink(self.clock, cost.storage, page_bytes)
            if hc.hicache_size > 0:  # GB of the modelled KV, not of the simulator's one-row pages
                ratio = hc.hicache_size * 1e9 / (page_bytes * cfg.num_pages)
                hc = dataclasses.replace(hc, hicache_size=0.0, hicache_ratio=ratio)
            consensus = Consensus(ParallelContext())  # one rank: agreement is the identity
            self.cache = hierarchical_cache(pool, hc, consensus, "simulated", make_worker=self._link,
                                            clock=lambda: self.clock.now)  # fmt: skip
        else:  # a P/D decode server keeps a tree only when asked to, as the engine's (roles.radix_enabled)
            self.cache = device_cache(pool, radix=radix_enabled(cfg))
        load_link = self.links["host->device"] if hc.enable_hierarchical_cache else None
        self.compute = CostedCompute(cost, self.clock, load_link)
        # No model and no tokenizer: the compute answers with trace tokens, which ignore EOS.
        self.scheduler = Scheduler(cfg, PoolOnly(pool), self.cache, None, SIMULATED_CONTEXT,  # type: ignore[arg-type]
                                   compute=self.compute, role=role(pool) if role is not None else None)  # fmt: skip
        # (virtual time, tokens each tier holds, cached or in use), whenever the time moved on
        self.occupancy: list[tuple[float, dict[str, int]]] = []

    def _link(self, name: str, _delay: float, _seed: int, _timeout: float) -> Worker:
        return self.links[LINK_OF_WORKER[name]]

    def run(self, trace: list[TraceRequest]) -> list[RequestRecord]:
        """Every request of `trace` to its end; one record each, in arrival order."""
        follower = {(t.conv_id, t.round): i for i, t in enumerate(trace) if t.after_previous}
        arrivals = [(t.arrival_s, i) for i, t in enumerate(trace) if not t.after_previous]
        heapq.heapify(arrivals)
        live: dict[int, _Live] = {}
        records: list[RequestRecord] = []
        ideal = IdealCache()
        while arrivals or self.scheduler.has_work:
            if not self.scheduler.has_work:
                self.clock.advance_to(arrivals[0][0])
            while arrivals and arrivals[0][0] <= self.clock.now:
                item = trace[heapq.heappop(arrivals)[1]]
                entry = self._arrive(item, ideal)
                live[entry.request.rid] = entry
                records.append(entry.record)
            for link in self.links.values():
                link.run_until(self.clock.now)
            steps = self.compute.steps
            for event in self.scheduler.step():
                entry = live[event.rid]
                if event.cached_tokens_by_tier is not None:
                    entry.record.ttft_s = self.clock.now - entry.record.send_time_s
                    entry.record.cached_tokens_by_tier = dict(event.cached_tokens_by_tier)
                    entry.record.cached_tokens = sum(event.cached_tokens_by_tier.values())
                if event.finish_reason is not None:
                    self._finish(live.pop(event.rid), ideal, follower, trace, arrivals)
            self.sample_occupancy()
            if self.compute.steps == steps and self.scheduler.has_work:
                self._wait(arrivals)
        for link in self.links.values():
            link.finish_all()
        return records

    def submit(self, prompt: list[int], output_ids: tuple[int, ...], bootstrap: Bootstrap | None = None) -> Request:
        """A request of `prompt` into the scheduler, answered by `output_ids`."""
        check_request_fits(self.cfg, SIMULATED_CONTEXT, len(prompt), len(output_ids))
        params = SamplingParams(max_new_tokens=len(output_ids), ignore_eos=True)
        request = Request(prompt, params, len(output_ids), bootstrap=bootstrap)
        self.compute.answers[request.rid] = output_ids
        self.scheduler.add(request)
        return request

    def _arrive(self, item: TraceRequest, ideal: IdealCache) -> _Live:
        prompt = item.prompt()
        request = self.submit(prompt, item.output_ids)
        record = RequestRecord(
            self.label, item.conv_id, item.group, item.round, self.clock.now, len(prompt), len(prompt),
            ideal_cached_tokens=ideal.on_send(prompt),
        )  # fmt: skip
        return _Live(item, request, record)

    def _finish(self, entry: _Live, ideal: IdealCache, follower: dict, trace: list, arrivals: list) -> None:
        entry.record.latency_s = self.clock.now - entry.record.send_time_s
        entry.record.output_tokens = len(entry.request.output_ids)
        ideal.on_finish(entry.request.prompt_ids, entry.request.output_ids)
        self.compute.answers.pop(entry.request.rid)
        after = follower.get((entry.trace.conv_id, entry.trace.round + 1))
        if after is not None:
            heapq.heappush(arrivals, (self.clock.now + trace[after].arrival_s, after))

    def sample_occupancy(self) -> None:
        if not self.occupancy or self.occupancy[-1][0] < self.clock.now:
            self.occupancy.append((self.clock.now, {tier: used for tier, (used, _) in self.cache.usage().items()}))

    def _wait(self, arrivals: list) -> None:
        """Nothing could run (admission waits for a copy to unlock pages): on to the next event."""
        times = [self.next_completion] + ([arrivals[0][0]] if arrivals else [])
        if min(times) == inf:
            raise RuntimeError("the simulator stalled: requests wait and nothing is in flight or to arrive")
        self.clock.advance_to(min(times))

    @property
    def next_completion(self) -> float:
        """When the next copy or storage call in flight ends (infinity: none is)."""
        return min((t for t in (link.next_completion for link in self.links.values()) if t is not None), default=inf)

    def bytes_moved(self) -> dict[str, int]:
        return {direction: n for link in self.links.values() for direction, n in link.moved().items()}

    def shutdown(self) -> None:
        self.cache.shutdown()
