"""The n-gram proposer's lookup against a brute-force reference: the longest suffix between the min and max
window with an earlier occurrence (the occurrence may overlap the suffix), its most recent occurrence, up to
k of the tokens after it, and nothing where no suffix of the min window occurred before; and the per-request
token arrays growing with the request as it decodes."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hicache.scheduler.model_runner import WorkItem
from hicache.scheduler.request import Request, SamplingParams
from hicache.spec.ngram import NgramProposer, ngram_proposal


def brute_force(tokens: list[int], min_window: int, max_window: int, k: int) -> list[int]:
    n = len(tokens)
    for w in range(min(max_window, n - 1), min_window - 1, -1):  # longest window first
        suffix = tokens[n - w :]
        for end in range(n - 1, w - 1, -1):  # most recent earlier occurrence first: it ends before n
            if tokens[end - w : end] == suffix:
                return tokens[end : end + k]
    return []


def sequences(alphabet: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, alphabet - 1), max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.one_of(sequences(2), sequences(4), sequences(50_000)),
    min_window=st.integers(1, 5),
    extra=st.integers(0, 6),
    k=st.integers(0, 8),
)
@example(tokens=[], min_window=1, extra=0, k=4)
@example(tokens=[7], min_window=1, extra=0, k=4)
@example(tokens=[7, 7], min_window=1, extra=0, k=4)  # the match overlaps the suffix: one token left after it
@example(tokens=[1, 2, 1, 2, 1, 2], min_window=2, extra=6, k=4)  # overlapping: [1, 2] after the 4-token match
@example(tokens=[1, 2, 3, 1, 2, 3], min_window=1, extra=2, k=0)  # k = 0 proposes nothing
@example(tokens=[1, 2, 3, 9, 2, 3], min_window=3, extra=0, k=4)  # only shorter suffixes recur
def test_matches_the_brute_force_reference(tokens, min_window, extra, k):
    max_window = min_window + extra
    got = ngram_proposal(np.array(tokens, dtype=np.int64), min_window, max_window, k)
    assert got == brute_force(tokens, min_window, max_window, k)
    assert len(got) <= k


def test_the_longest_window_wins_over_a_more_recent_shorter_match():
    # "5 1 2" occurred at the start (followed by 8); "1 2" alone more recently (followed by 9).
    tokens = np.array([5, 1, 2, 8, 0, 1, 2, 9, 0, 5, 1, 2])
    assert ngram_proposal(tokens, 2, 3, 2) == [8, 0]
    assert ngram_proposal(tokens, 2, 2, 2) == [9, 0]  # capped at 2: the most recent "1 2"


def item(req: Request) -> WorkItem:
    end = req.prompt_len + len(req.output_ids)
    return WorkItem(req, end - 1, end)


def test_the_proposer_follows_each_request_as_it_decodes_and_drops_the_ended():
    proposer = NgramProposer(1, 4)
    a = Request([1, 2, 3, 4, 1, 2], SamplingParams(), 16)
    b = Request([9, 8, 9], SamplingParams(), 16)
    assert proposer.propose([], [item(a), item(b)], [3, 0], None) == [[3, 4, 1], []]
    a.output_ids += [3, 4, 1]  # it accepted them and decoded on
    assert proposer.propose([], [item(a)], [2], None) == [[2, 3]]  # "2 3 4 1" recurs: [2, 3] after it
    assert list(proposer._tokens) == [a.rid]  # b ended: its array went with it
    b2 = Request([7, 7, 7], SamplingParams(), 16)
    assert proposer.propose([], [item(b2)], [4], None) == [[7]]  # "7 7" last ended one before the end
