"""Next-token choice on hand-made logits: greedy is the argmax, seeded sampling repeats, top-k and
top-p keep only what they should, log-probabilities are those of the unscaled distribution, and a batch's
rows choose what each would alone."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.scheduler.request import Request, SamplingParams
from hicache.scheduler.sampler import sample, sample_rows

LOGITS = torch.tensor([0.5, 3.0, 2.9, -1.0, 1.0])


def req(seed: int | None = None, **params) -> Request:
    r = Request([1, 2, 3], SamplingParams(max_new_tokens=4, seed=seed, **params), 4)
    if seed is not None:
        r.generator = torch.Generator().manual_seed(seed)
    return r


def draws(n: int, logits: torch.Tensor = LOGITS, **params) -> list[int]:
    r = req(seed=7, **params)
    return [sample(logits, r)[0] for _ in range(n)]


def test_greedy_is_the_argmax_and_reports_no_logprobs():
    assert sample(LOGITS, req()) == (1, None)


def test_seeded_sampling_repeats_and_seeds_differ():
    assert draws(30, temperature=1.0) == draws(30, temperature=1.0)
    other = req(seed=8, temperature=1.0)
    assert draws(30, temperature=1.0) != [sample(LOGITS, other)[0] for _ in range(30)]


def test_top_k_keeps_the_k_best():
    assert set(draws(200, temperature=5.0, top_k=2)) == {1, 2}
    assert set(draws(20, temperature=5.0, top_k=1)) == {1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, 0)  # tokens 1 and 2 hold about 0.8 of the mass
    mass = float(probs[1] + probs[2])
    assert set(draws(200, temperature=1.0, top_p=mass - 0.01)) == {1, 2}
    assert set(draws(20, temperature=1.0, top_p=1e-9)) == {1}, "the best token always stays"


def test_logprobs_are_of_the_unscaled_distribution():
    token, lp = sample(LOGITS, req(logprobs=3))
    want = torch.log_softmax(LOGITS, 0)
    assert token == 1 and lp is not None and lp.token_id == 1
    assert math.isclose(lp.logprob, float(want[1]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2, 4]
    assert all(math.isclose(v, float(want[t]), rel_tol=1e-6) for t, v in lp.top)
    _, hot = sample(LOGITS, req(seed=1, temperature=2.0, logprobs=0))
    assert hot is not None and hot.top == () and math.isclose(hot.logprob, float(want[hot.token_id]), rel_tol=1e-6)


@settings(max_examples=50, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=2, max_size=40),
    top_k=st.integers(0, 5),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**31),
)
def test_a_sample_is_always_a_token_the_filters_allow(logits, top_k, top_p, seed):
    t = torch.tensor(logits)
    token, _ = sample(t, req(seed=seed, temperature=1.0, top_k=top_k, top_p=top_p))
    assert 0 <= token < len(logits)
    if top_k:
        assert t[token] >= torch.topk(t, min(top_k, len(logits))).values[-1]


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(st.lists(st.sampled_from([-2.0, 0.0, 0.5, 3.0]), min_size=6, max_size=6),
                  min_size=1, max_size=6),
    kinds=st.lists(st.sampled_from(["greedy", "logprobs", "sampled"]), min_size=6, max_size=6),
)
def test_a_batchs_rows_choose_what_each_would_alone(rows, kinds):
    """Ties included: the batch's one argmax over its greedy rows picks each row's first
    largest, as a row's own argmax does; rows with log-probabilities or sampling are sampled alone."""
    params = {"greedy": {}, "logprobs": {"logprobs": 2}, "sampled": {"temperature": 1.0}}
    logits = torch.tensor(rows)

    def reqs() -> list[Request]:  # fresh seeded generators: sampled rows draw the same in both runs
        return [req(seed=3, **params[kind]) for kind in kinds[: len(rows)]]

    assert sample_rows(logits, reqs()) == [sample(logits[i], r) for i, r in enumerate(reqs())]
