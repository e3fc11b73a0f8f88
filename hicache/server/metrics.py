"""Serving: Prometheus metrics of one server, on a registry of its own (no process-global state, so
several apps can live in one process, as the tests run them).

Counters and the TTFT histogram are fed by the request bridge as events arrive; pool occupancy, queue
lengths and the tiers' (and a P/D role's) counters come from one engine snapshot taken when /metrics is
scraped (`Engine.snapshot`: one command to the ranks), so they are never stale and agree with each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.cache import TIERS, CacheStats, RetentionStats
from hicache.disagg.stats import DisaggStats
from hicache.engine.engine import Engine
from hicache.scheduler.request import FinishReason
from hicache.spec.stats import SpecStats

REQUEST_STATUSES = tuple(r.value for r in FinishReason) + ("rejected",)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    """Gauges and counters of one engine snapshot, taken at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        snap = self._engine.snapshot()
        used = GaugeMetricFamily("hicache_pool_used_tokens", "KV tokens in use (running or cached)", labels=["tier"])
        capacity = GaugeMetricFamily("hicache_pool_capacity_tokens", "KV pool capacity in tokens", labels=["tier"])
        for tier, (n_used, n_capacity) in snap.pool_usage.items():
            used.add_metric([tier], n_used)
            capacity.add_metric([tier], n_capacity)
        yield used
        yield capacity
        resident = GaugeMetricFamily(
            "hicache_kv_resident_bytes",
            "KV bytes each rank holds (its own pages when sharded)",
            labels=["rank", "tier"],
        )
        for rank, tiers in snap.kv_bytes_by_rank.items():
            for tier, n in tiers.items():
                resident.add_metric([rank, tier], n)
        yield resident
        yield from _tier_counters(snap.cache)
        yield from _retention_metrics(snap.cache.retention)
        yield from _spec_counters(snap.spec)
        yield from disagg_counters(snap.disagg)
        yield GaugeMetricFamily("hicache_requests_running", "requests in the running batch", snap.running)
        yield GaugeMetricFamily("hicache_requests_waiting", "requests waiting for admission", snap.waiting)
        yield GaugeMetricFamily(
            "hicache_batch_invariance_verified",
            "1 if the start-up self-check found every token's logits independent of chunking and batching",
            float(self._engine.invariance["verified"]),
        )


PREFETCH_STAGES = ("queried", "hit", "allocated", "read", "inserted")  # fields of PrefetchStats, in order


def _tier_counters(stats: CacheStats) -> Iterator[Metric]:
    """The cache tiers' counters: transfers, storage results, and each prefetch stage with the reason
    every lost page was lost. Label values are the typed fields' names (storage ones prefixed
    `storage_`), so the series keep their names as the tiers gain counters."""
    lost = CounterMetricFamily(
        "hicache_prefetch_lost_pages",
        "pages found in storage that did not serve a request, by reason",
        labels=["reason"],
    )
    stages = CounterMetricFamily(
        "hicache_prefetch_pages",
        "storage prefetch lifecycle: queried, hit, allocated, read, inserted",
        labels=["stage"],
    )
    events = CounterMetricFamily("hicache_cache_events", "cache tier counters (transfers, storage)", labels=["event"])
    counts: dict[str, int] = {}
    for part in (stats.host, stats.workers):
        if part is not None:
            counts.update(dataclasses.asdict(part))
    if stats.storage is not None:
        tier = dataclasses.asdict(stats.storage)  # its own counters (the nested ones come below)
        counts.update({f"storage_{name}": n for name, n in tier.items() if isinstance(n, int)})
        counts.update({f"storage_{name}": n for name, n in dataclasses.asdict(stats.storage.store).items()})
        prefetch = stats.storage.prefetch
        for stage in sorted(PREFETCH_STAGES):
            stages.add_metric([stage], getattr(prefetch, stage))
        for reason, n in sorted(prefetch.lost.items(), key=lambda item: item[0].value):
            lost.add_metric([reason.value], n)
    for event, n in sorted(counts.items()):
        events.add_metric([event], n)
    yield from (lost, stages, events)


def _retention_metrics(stats: RetentionStats | None) -> Iterator[Metric]:
    """What retention hints hold and what pressure took anyway (docs/DESIGN.md, "retention hints")."""
    if stats is None:
        return
    held = GaugeMetricFamily(
        "hicache_retention_held_pages", "cached pages whose retention priority is above 0 now", labels=["tier"]
    )
    evicted = CounterMetricFamily(
        "hicache_retention_evicted_pages",
        "pages evicted while still retained (nothing of lower priority was left to evict)",
        labels=["tier"],
    )
    deferred = CounterMetricFamily(
        "hicache_retention_deferred_evictions",
        "evictions that took another node where plain LRU would have taken a retained one",
        labels=["tier"],
    )
    for tier, n_held, n_evicted, n_deferred in (
        ("device", stats.held_device_pages, stats.evicted_retained_device_pages, stats.deferred_device_evictions),
        ("host", stats.held_host_pages, stats.evicted_retained_host_pages, stats.deferred_host_evictions),
    ):
        held.add_metric([tier], n_held)
        evicted.add_metric([tier], n_evicted)
        deferred.add_metric([tier], n_deferred)
    lapsed = CounterMetricFamily(
        "hicache_retention_lapsed_nodes", "cached prefixes whose retention ran out (back to plain LRU)",
        stats.lapsed_nodes,
    )
    yield from (held, deferred, evicted, lapsed)


SPEC_COUNTERS = (  # (metric, SpecStats field, help), exported only with speculative decoding
    ("hicache_spec_proposed_tokens", "proposed_tokens", "draft tokens proposed and verified by the target"),
    ("hicache_spec_accepted_tokens", "accepted_tokens", "proposed draft tokens the target accepted"),
    ("hicache_spec_draft_recomputed_tokens", "draft_recomputed_tokens",
     "draft rows computed over a cached prefix whose draft state was not restored with the target's"),
)  # fmt: skip


def _spec_counters(stats: SpecStats | None) -> Iterator[Metric]:
    if stats is None:
        return
    for name, field, doc in SPEC_COUNTERS:
        yield CounterMetricFamily(name, doc, getattr(stats, field))


def disagg_counters(stats: DisaggStats | None) -> Iterator[Metric]:
    """The transfer counters of a P/D role (none on a server without one)."""
    if stats is None:
        return
    received = CounterMetricFamily(
        "hicache_disagg_received_tokens",
        "prompt tokens whose KV arrived from prefill (decode)",
        value=stats.received_tokens,
    )
    received_bytes = CounterMetricFamily(
        "hicache_disagg_received_bytes",
        "bytes of KV received from prefill, every rank's shard (decode)",
        value=stats.received_bytes,
    )
    prefix = CounterMetricFamily(
        "hicache_disagg_decode_prefix_tokens",
        "prompt tokens decode served from its own tree instead of receiving them, by tier (decode)",
        labels=["tier"],
    )
    for tier in TIERS:
        prefix.add_metric([tier], stats.decode_prefix_tokens.get(tier, 0))
    sent = CounterMetricFamily(
        "hicache_disagg_sent_tokens", "prompt tokens whose KV was sent to decode (prefill)", value=stats.sent_tokens
    )
    sent_bytes = CounterMetricFamily(
        "hicache_disagg_sent_bytes",
        "bytes of KV sent to decode, every rank's shard (prefill)",
        value=stats.sent_bytes,
    )
    staged = GaugeMetricFamily(
        "hicache_disagg_peak_staged_bytes",
        "the most KV bytes a prefill rank held in host memory at once on their way to decode (prefill)",
        value=stats.peak_staged_bytes,
    )
    transfers = CounterMetricFamily(
        "hicache_disagg_transfers", "KV transfers by outcome (ok, failed)", labels=["outcome"]
    )
    transfers.add_metric(["ok"], stats.transfers_ok)
    transfers.add_metric(["failed"], stats.transfers_failed)
    role = (received, received_bytes, prefix) if stats.role == "decode" else (sent, sent_bytes, staged)
    yield from (*role, transfers)


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            "hicache_prompt_tokens", "prompt tokens of admitted requests", registry=self.registry
        )
        self.generation_tokens = Counter("hicache_generation_tokens", "tokens generated", registry=self.registry)
        self.cached_tokens = Counter(
            "hicache_cached_tokens", "prompt tokens served from cache, by memory tier", ["tier"], registry=self.registry
        )
        self.ttft = Histogram(
            "hicache_time_to_first_token_seconds",
            "time from submission to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "hicache_requests",
            "finished requests by outcome (a finish reason, or rejected as bad input)",
            ["status"],
            registry=self.registry,
        )
        # Export every label from the start, so a dashboard sees zeros rather than missing series.
        for tier in TIERS:
            self.cached_tokens.labels(tier=tier)
        for status in REQUEST_STATUSES:
            self.requests.labels(status=status)
        self.registry.register(_EngineCollector(engine))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
