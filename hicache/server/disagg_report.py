"""Serving: what a prefill-decode server reports about its KV transfers (hicache/disagg/): the usage
fields of a decode server's responses and the `hicache_disagg_*` metrics.

In a decode server's usage, `cached_tokens` (and its tiers) are prefill's: the prompt tokens whose
computation was skipped, never more than `prompt_tokens`. Decode's own reuse is reported apart, as
`decode_prefix_tokens` (the page-aligned prefix it served from its tree, so prefill did not send it)
and `transferred_tokens` (the prompt tokens whose KV arrived); the two add up to `prompt_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.cache.api import TIERS
from hicache.runtime.engine import Engine
from hicache.server.bridge import Choice


def disagg_details(choices: Sequence[Choice]) -> dict[str, int]:
    """The P/D fields of `usage.prompt_tokens_details` (none on a server without a decode role)."""
    reports = [c.disagg for c in choices if c.disagg is not None]
    if not reports:
        return {}
    return {
        "decode_prefix_tokens": sum(r.decode_prefix_tokens for r in reports),
        "transferred_tokens": sum(r.transferred_tokens for r in reports),
    }


class DisaggCollector(Collector):
    """The transfer counters of a P/D role, read from the engine at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.disagg_stats()
        if stats is None:
            return
        received = CounterMetricFamily(
            "hicache_disagg_received_tokens", "prompt tokens whose KV arrived from prefill (decode)"
        )
        received.add_metric([], stats.received_tokens)
        received_bytes = CounterMetricFamily(
            "hicache_disagg_received_bytes", "bytes of KV received from prefill, every rank's shard (decode)"
        )
        received_bytes.add_metric([], stats.received_bytes)
        prefix = CounterMetricFamily(
            "hicache_disagg_decode_prefix_tokens",
            "prompt tokens decode served from its own tree instead of receiving them, by tier (decode)",
            labels=["tier"],
        )
        for tier in TIERS:
            prefix.add_metric([tier], stats.decode_prefix_tokens.get(tier, 0))
        sent = CounterMetricFamily("hicache_disagg_sent_tokens", "prompt tokens whose KV was sent to decode (prefill)")
        sent.add_metric([], stats.sent_tokens)
        sent_bytes = CounterMetricFamily(
            "hicache_disagg_sent_bytes", "bytes of KV sent to decode, every rank's shard (prefill)"
        )
        sent_bytes.add_metric([], stats.sent_bytes)
        transfers = CounterMetricFamily(
            "hicache_disagg_transfers", "KV transfers by outcome (ok, failed)", labels=["outcome"]
        )
        transfers.add_metric(["ok"], stats.transfers_ok)
        transfers.add_metric(["failed"], stats.transfers_failed)
        role = (received, received_bytes, prefix) if stats.role == "decode" else (sent, sent_bytes)
        yield from (*role, transfers)
