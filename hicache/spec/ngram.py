"""Draft-free proposals (docs/DESIGN.md, "Speculative decoding: n-gram proposals"): the `Proposer` of
`--speculative-algorithm ngram`, prompt lookup as vLLM's and SGLang's n-gram speculation do it. The longest
suffix of a request's tokens (prompt and output so far), between the minimum and the maximum match window,
that occurred earlier in them is looked up, and the up to K tokens that followed its most recent earlier
occurrence are proposed: where a model copies (code quoted back with an edit, tool output, a passage to
repeat), the tokens after the last place it read the same words are what it writes next.

There is no model, no pool and no state in the cache: a proposal is a function of the request's tokens,
which are the same on every rank, so every rank proposes the same tokens with no message. What it costs is
the verify rows (up to K more rows in the target's pass per request and step, rejected or not) and a scan
of the request's tokens per step (vectorised, on an array kept per decoding request and grown as it
decodes).
"""

from __future__ import annotations

import numpy as np

from hicache.scheduler.model_runner import WorkItem
from hicache.scheduler.request import Request
from hicache.spec.proposer import HiddenSink, LayerHook


def ngram_proposal(tokens: np.ndarray, min_window: int, max_window: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of `tokens`
    between `min_window` and `max_window` tokens long; none where the suffix of `min_window` never
    occurred before."""
    n = len(tokens)
    if k <= 0 or n <= min_window:
        return []
    # The ends (the index after) of the earlier occurrences of the suffix's last w tokens, for w = 1, 2, ...:
    # each longer window keeps those that also match one token further back. Ascending: the last is the latest.
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1]) + 1
    best = None
    for w in range(1, max_window + 1):
        if w > 1:
            ends = ends[ends >= w]
            ends = ends[tokens[ends - w] == tokens[n - w]]
        if not len(ends):
            break
        if w >= min_window:
            best = int(ends[-1])
    return [] if best is None else tokens[best : best + k].tolist()


class _Tokens:
    """One request's known tokens as an array: they only grow, so each step copies only the new ones."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.int64)
        self._len = 0

    def of(self, req: Request) -> np.ndarray:
        known = req.prompt_len + len(req.output_ids)
        if known > len(self._buf):
            grown = np.empty(max(known, 2 * len(self._buf)), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        new = req.prompt_ids[self._len :] + req.output_ids[max(0, self._len - req.prompt_len) :]
        self._buf[self._len : known] = new
        self._len = known
        return self._buf[:known]


class NgramProposer:
    target_sink: HiddenSink | None = None  # it reads nothing of the target's pass
    recomputed_tokens = 0  # it has no state to recompute

    def __init__(self, min_window: int, max_window: int) -> None:
        self.min_window = min_window
        self.max_window = max_window
        self._tokens: dict[int, _Tokens] = {}  # by rid

    def propose(
        self, work: list[WorkItem], decoding: list[WorkItem], limits: list[int], before_layer: LayerHook | None
    ) -> list[list[int]]:
        # Every running decode request is in every step's work: the arrays of the others (ended, or sent
        # back to waiting) are dropped here.
        self._tokens = {item.req.rid: self._tokens.get(item.req.rid) or _Tokens() for item in decoding}
        return [
            ngram_proposal(self._tokens[item.req.rid].of(item.req), self.min_window, self.max_window, k) if k else []
            for item, k in zip(decoding, limits)
        ]

    def after_target(self, work: list[WorkItem], target_work: list[WorkItem], before_layer: LayerHook | None) -> None:
        pass
