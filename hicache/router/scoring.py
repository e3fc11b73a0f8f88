"""The cache-aware policy's arithmetic (docs/DESIGN.md, "router"): what a server's cache saves a request,
what its load costs, and which server is cheapest.

A server's cost for a prompt of P tokens is the prefill work it would still do, in tokens, plus its
load: P - saved + load_weight * in-flight tokens, where `saved` counts each leading cached page
(KV events, BlockIndex.prefix_tiers) at its tier's weight: a device page is free, a host page costs a
copy back, a storage page a read and a copy. In-flight tokens are the prompt tokens of the requests
this router sent the server that have not finished. The cheapest server wins; ties go to the one with
fewer requests in flight, then to the one picked least recently, so with nothing cached anywhere the
policy is "least loaded" and spreads equal loads round the servers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# What one cached page saves, as a fraction of computing it: a host page is copied back to the device
# (hicache/cache/restores.py), a storage page read, verified and copied twice.
TIER_WEIGHTS = {"device": 1.0, "host": 0.75, "storage": 0.5}
# How much prefill one in-flight prompt token is worth: below 1 because a batch shares each step, so a
# busy server still computes a cached prefix's remainder sooner than an idle one computes the whole.
LOAD_WEIGHT = 0.5


@dataclass(frozen=True)
class Load:
    """What the router has sent a server and not yet seen finish."""

    requests: int = 0
    tokens: int = 0


def saved_tokens(prefix_tiers: Sequence[str], page_size: int) -> float:
    """The prefill tokens a server's cached prefix saves (each leading page at its tier's weight)."""
    return page_size * sum(TIER_WEIGHTS[tier] for tier in prefix_tiers)


def cost(prompt_tokens: int, saved: float, load: Load, load_weight: float = LOAD_WEIGHT) -> float:
    """The work, in prefill tokens, of sending this prompt to a server that `saved` and carries `load`."""
    return max(prompt_tokens - saved, 0.0) + load_weight * load.tokens


def cheapest(costs: Sequence[float], loads: Sequence[Load], last_picked: Sequence[int]) -> int:
    """The index of the cheapest server; ties to fewer requests in flight, then to the one picked least
    recently (`last_picked`: the number of the request each server was last picked for; -1: never)."""
    return min(range(len(costs)), key=lambda i: (costs[i], loads[i].requests, last_picked[i]))
