"""Benchmark metrics (the `bench` part of the design): per-request records, the workload's ideal hit
rate, and the per-arm summary.

Ideal hit rate — the ceiling every measured hit rate is shown against.
    An *infinite cache* holds every token sequence the server has computed since its cache was last
    emptied: for each earlier request, its prompt tokens and its prompt tokens followed by its generated
    output tokens (and, by implication, every prefix of those). The *reusable* part of a request is the
    longest common prefix of its prompt tokens with any sequence held at the moment it is sent; the
    ideal hit rate of a set of requests is the sum of their reusable parts over the sum of their prompt
    tokens. "Earlier" is send order: a prompt counts as held from the moment it is sent (a server
    running it can at best share it), its output from the moment its answer has arrived. This is an
    upper bound, not a prediction: a real cache also rounds down to whole pages, never serves a
    request's last prompt token from cache, and forgets what it evicts.
    The bound holds for sums, not request by request: of two requests that share a prefix and are in
    flight together, the ideal credits the reuse to the one sent second, a server to the one it
    scheduled second. Over prompts the sum does not depend on the order: the reusable tokens of a set
    of prompts are their total length minus the size of the trie they form.
    The output tokens are the tokenization of the answer text the client received (the OpenAI API does
    not return the server's token ids). The next turn's prompt carries that same text, re-tokenized, so
    where detokenization is not invertible the ideal still follows the prompt further than the
    server's own ids would.

`PrefixIndex` is a compressed trie (radix tree) of token sequences with numpy edges: inserting or
matching a sequence of n tokens costs O(n) in vectorized comparisons plus one dict lookup per branch, so
thousands of requests of thousands of tokens take well under a second.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from hicache.cache import TIERS


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.size else n


class _Node:
    __slots__ = ("children", "edge")

    def __init__(self, edge: np.ndarray) -> None:
        self.edge = edge  # the tokens on the edge from the parent into this node
        self.children: dict[int, _Node] = {}


class PrefixIndex:
    """A set of token sequences closed under prefixes; answers "longest prefix of q held in the set"."""

    def __init__(self) -> None:
        self._root = _Node(np.empty(0, dtype=np.int64))

    def longest_prefix(self, tokens: Sequence[int] | np.ndarray) -> int:
        query = np.asarray(tokens, dtype=np.int64)
        node, pos = self._root, 0
        while pos < len(query):
            child = node.children.get(int(query[pos]))
            if child is None:
                return pos
            k = _common_prefix_len(child.edge, query[pos:])
            pos += k
            if k < len(child.edge):
                return pos
            node = child
        return pos

    def insert(self, tokens: Sequence[int] | np.ndarray) -> None:
        seq = np.asarray(tokens, dtype=np.int64)
        node, pos = self._root, 0
        while pos < len(seq):
            head = int(seq[pos])
            child = node.children.get(head)
            if child is None:
                node.children[head] = _Node(seq[pos:].copy())
                return
            k = _common_prefix_len(child.edge, seq[pos:])
            if k < len(child.edge):
                # Split the edge where the new sequence leaves it.
                middle = _Node(child.edge[:k])
                child.edge = child.edge[k:]
                middle.children[int(child.edge[0])] = child
                node.children[head] = middle
                child = middle
            node, pos = child, pos + k


class IdealCache:
    """The infinite cache of the module docstring, fed in the order events happened at the server."""

    def __init__(self) -> None:
        self._index = PrefixIndex()

    def on_send(self, prompt_ids: Sequence[int]) -> int:
        """Returns the reusable prefix length of a prompt being sent, then holds the prompt."""
        reusable = self._index.longest_prefix(prompt_ids)
        self._index.insert(prompt_ids)
        return reusable

    def on_finish(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self._index.insert(np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)]))

    def clear(self) -> None:
        self._index = PrefixIndex()


@dataclass
class RequestRecord:
    """One measured request: one row of the output file (`type: request`).

    `prompt_tokens` is the server's count (usage), `prompt_tokens_client` the benchmark's own
    tokenization of what it sent; they agree when the server renders and tokenizes as the client does.
    `cached_tokens_by_tier` is None where the server does not report tiers.
    """

    arm: str
    conv_id: int
    group: int
    round: int
    send_time_s: float
    prompt_tokens: int = 0
    prompt_tokens_client: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None
    transferred_tokens: int | None = None  # P/D only (None elsewhere)
    ideal_cached_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    spec_proposed_tokens: int | None = None  # None where the server does not speculate (or say so)
    spec_accepted_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, object]:
        return {"type": "request", **asdict(self), "tpot_s": self.tpot_s}


def _stats(prefix: str, values: Iterable[float | None]) -> dict[str, float | None]:
    data = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if not data.size:
        return {f"{prefix}_mean_s": None, f"{prefix}_median_s": None, f"{prefix}_p99_s": None}
    return {
        f"{prefix}_mean_s": float(data.mean()),
        f"{prefix}_median_s": float(np.median(data)),
        f"{prefix}_p99_s": float(np.percentile(data, 99)),
    }


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def hit_rates(records: Sequence[RequestRecord]) -> dict[str, object]:
    """Hit rate, ideal hit rate and per-tier hit rates of successful records.

    hit_rate = Σ cached_tokens / Σ prompt_tokens; ideal_hit_rate = Σ ideal_cached_tokens /
    Σ prompt_tokens_client; a tier's rate = Σ that tier's cached tokens / Σ prompt_tokens over the
    records that report tiers (all None when none does).
    """
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    tiered = [r for r in ok if r.cached_tokens_by_tier is not None]
    tiered_prompt = sum(r.prompt_tokens for r in tiered)
    by_tier = {
        tier: _ratio(sum(r.cached_tokens_by_tier.get(tier, 0) for r in tiered), tiered_prompt) if tiered else None
        for tier in TIERS
    }
    return {
        "hit_rate": _ratio(sum(r.cached_tokens for r in ok), prompt),
        "ideal_hit_rate": _ratio(sum(r.ideal_cached_tokens for r in ok), sum(r.prompt_tokens_client for r in ok)),
        "hit_rate_by_tier": by_tier,
    }


def summarize(arm: str, records: Sequence[RequestRecord], duration_s: float, extra: dict[str, object]) -> dict:
    """The summary row of one arm (`type: summary`). Latencies are over successful requests; ITL pools
    the gaps between streamed chunks of every request, as SGLang's bench_serving does."""
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, object] = {
        "type": "summary",
        "arm": arm,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ideal_cached_tokens": sum(r.ideal_cached_tokens for r in ok),
        "request_throughput": _ratio(len(ok), duration_s),
        "input_throughput": _ratio(input_tokens, duration_s),
        "output_throughput": _ratio(output_tokens, duration_s),
        **_stats("ttft", (r.ttft_s for r in ok)),
        **_stats("tpot", (r.tpot_s for r in ok)),
        **_stats("itl", (gap for r in ok for gap in r.itl_s)),
        **_stats("e2e_latency", (r.latency_s for r in ok)),
        **hit_rates(records),
    }
    summary["tiers_reported"] = any(r.cached_tokens_by_tier is not None for r in ok)
    summary.update(spec_acceptance(ok))
    moved = [r.transferred_tokens for r in ok if r.transferred_tokens is not None]
    summary["transferred_tokens"] = sum(moved) if moved else None
    summary["per_round"] = [
        {"round": rnd, "requests": len(group), **hit_rates(group), **_stats("ttft", (r.ttft_s for r in group if r.ok))}
        for rnd, group in _by_round(records)
    ]
    summary.update(extra)
    return summary


def spec_acceptance(records: Sequence[RequestRecord]) -> dict[str, object]:
    """Draft tokens proposed and accepted over the records that report them, and their ratio (None
    where no record does: the server did not speculate)."""
    spec = [r for r in records if r.spec_proposed_tokens is not None]
    proposed = sum(r.spec_proposed_tokens or 0 for r in spec)
    accepted = sum(r.spec_accepted_tokens or 0 for r in spec)
    return {
        "spec_proposed_tokens": proposed if spec else None,
        "spec_accepted_tokens": accepted if spec else None,
        "spec_acceptance_rate": _ratio(accepted, proposed) if spec else None,
    }


def _by_round(records: Sequence[RequestRecord]) -> list[tuple[int, list[RequestRecord]]]:
    rounds: dict[int, list[RequestRecord]] = {}
    for record in records:
        rounds.setdefault(record.round, []).append(record)
    return sorted(rounds.items())
