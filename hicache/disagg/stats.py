"""P/D disaggregation: a role's typed counters, read at /metrics scrape time (`hicache_disagg_*`) through
the `disagg_stats` control command (one rank's record each, combined across ranks by `combine`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from hicache.cache import TIERS


@dataclass
class DisaggStats:
    role: str
    # decode: prompt tokens of completed transfers, and the bytes landed so far (this rank's shard)
    received_tokens: int = 0
    received_bytes: int = 0
    # decode: prompt tokens not transferred because decode's own tree held them, by tier
    decode_prefix_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    # prefill: prompt tokens handed to the transport, and the bytes sent so far (this rank's shard)
    sent_tokens: int = 0
    sent_bytes: int = 0
    # prefill: the most KV bytes held in host memory at once on their way out (bounded by a couple of
    # transfer chunks per transfer in flight, whatever the prompt's length: docs/DESIGN.md, "P/D streaming")
    peak_staged_bytes: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0

    def snapshot(self) -> DisaggStats:
        return replace(self, decode_prefix_tokens=dict(self.decode_prefix_tokens))

    @staticmethod
    def combine(ranks: Sequence[DisaggStats]) -> DisaggStats:
        """One deployment's record: token counts are logical (the same on every rank, rank 0's is
        taken), bytes are per shard (summed), the staging peak is per process (the highest rank's)."""
        first = ranks[0].snapshot()
        first.received_bytes = sum(r.received_bytes for r in ranks)
        first.sent_bytes = sum(r.sent_bytes for r in ranks)
        first.peak_staged_bytes = max(r.peak_staged_bytes for r in ranks)
        return first
