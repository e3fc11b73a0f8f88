"""Counters of speculative decoding (docs/DESIGN.md, "speculative decoding"), exported as
`hicache_spec_*` metrics (hicache/server/metrics.py).

`draft_recomputed_tokens` counts the draft's rows over prompt tokens the target did not compute:
a cached prefix whose draft state was not restored with the target's. With the cache keeping both
(every tier), it stays 0; `--debug-skip-draft-restore` makes it count what a hit cost the draft.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    proposed_tokens: int = 0  # draft tokens the target verified
    accepted_tokens: int = 0  # of those, the ones it agreed with
    verify_steps: int = 0  # (K+1)-row verify passes of requests, summed over requests
    draft_recomputed_tokens: int = 0  # draft rows over a cached prefix (its state was not restored)
