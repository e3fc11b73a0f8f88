"""Scheduler behaviour a user notices: continuous batching, chunked prefill, admission, sampling, stops."""

import time

import pytest

from hicache import Engine, SamplingParams
from hicache.errors import RequestTooLargeError, UserError
from hicache.scheduler.request import FinishReason


@pytest.fixture(scope="module")
def engine():
    with Engine(model="tiny", max_total_tokens=4096, chunked_prefill_size=256) as e:
        yield e


@pytest.mark.slow
def test_new_request_joins_running_decode_batch(engine):
    long = engine.submit(list(range(40, 90)), SamplingParams(max_new_tokens=200, ignore_eos=True))
    events = iter(long)
    next(events)  # the long request is decoding
    short = engine.submit(list(range(50, 70)), SamplingParams(max_new_tokens=3, ignore_eos=True)).result()
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    rest = [e for e in events]
    assert rest[-1].finish_reason == FinishReason.LENGTH
    # The short one finished while the long one was still running: they shared decode steps.
    assert len(rest) > 3


def test_chunked_prefill_gives_same_tokens():
    prompt = [(i * 7) % 200 + 30 for i in range(900)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    outs = []
    for chunk in (64, 100, 4096):
        with Engine(model="tiny", chunked_prefill_size=chunk, disable_radix_cache=True) as e:
            outs.append(e.generate([prompt], params)[0].token_ids)
    assert outs[0] == outs[1] == outs[2]


def test_request_that_can_never_fit_fails_at_once():
    with Engine(model="tiny", max_total_tokens=256, page_size=16) as e:
        with pytest.raises(RequestTooLargeError, match="KV pages"):
            e.submit(list(range(32, 232)), SamplingParams(max_new_tokens=100))
        with pytest.raises(RequestTooLargeError, match="context length"):
            e.submit([65] * 5000, SamplingParams(max_new_tokens=1))
        # The engine still serves after refusing.
        assert e.generate([[65, 66]], SamplingParams(max_new_tokens=2))[0].finish_reason in ("length", "stop")


@pytest.mark.slow
def test_requests_larger_than_free_memory_wait_their_turn():
    # Each request needs most of the pool: they must run one after another, never run out mid-way.
    with Engine(model="tiny", max_total_tokens=512, page_size=16) as e:
        prompts = [[40 + i] * 300 for i in range(4)]
        results = e.generate(prompts, SamplingParams(max_new_tokens=150, ignore_eos=True))
        assert [len(r.token_ids) for r in results] == [150] * 4
        assert e.flush_cache() and e.leak_report() == []


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    a = engine.generate([[70, 71, 72]], params)[0].token_ids
    b = engine.generate([[70, 71, 72]], params)[0].token_ids
    c = engine.generate([[70, 71, 72]], SamplingParams(max_new_tokens=20, temperature=0.9, seed=8, ignore_eos=True))
    assert a == b
    assert a != c[0].token_ids


def test_stop_token_and_stop_string(engine):
    greedy = engine.generate([[80, 81, 82]], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    stop_id = greedy.token_ids[5]
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(stop_id,), ignore_eos=True)
    r = engine.generate([[80, 81, 82]], params)[0]
    assert r.finish_reason == "stop" and r.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_id) + 1]
    text = greedy.text
    at = next(i for i in range(1, len(text) - 1) if text[i : i + 2].isascii())
    stop = text[at : at + 2]
    r = engine.generate([[80, 81, 82]], SamplingParams(max_new_tokens=30, stop=(stop,), ignore_eos=True))[0]
    assert r.finish_reason == "stop" and r.text == text[: text.index(stop)]


def test_max_new_tokens_and_cache_salt(engine):
    prompt = list(range(33, 33 + 64))
    a = engine.generate([prompt], SamplingParams(max_new_tokens=4), cache_salt="alice")[0]
    b = engine.generate([prompt], SamplingParams(max_new_tokens=4), cache_salt="bob")[0]
    c = engine.generate([prompt], SamplingParams(max_new_tokens=4), cache_salt="alice")[0]
    assert len(a.token_ids) <= 4 and a.token_ids == b.token_ids == c.token_ids
    assert b.cached_tokens == 0, "another salt must not share pages"
    assert c.cached_tokens > 0


def test_cancel_frees_pages(engine):
    handle = engine.submit(list(range(40, 100)), SamplingParams(max_new_tokens=2000, ignore_eos=True))
    first = next(iter(handle))
    assert first.new_token_ids
    handle.cancel()
    assert handle.result().finish_reason == "abort"
    deadline = time.time() + 5
    while engine.num_running and time.time() < deadline:
        time.sleep(0.01)
    assert engine.flush_cache() and engine.leak_report() == []


def test_bad_sampling_params():
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(logprobs=99)):
        with pytest.raises(UserError):
            SamplingParams(**bad)


def test_vanishing_top_p_keeps_the_best_token(engine):
    params = SamplingParams(max_new_tokens=5, temperature=1.0, top_p=7e-207, seed=1, ignore_eos=True)
    greedy = engine.generate([[90, 91]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].token_ids
    assert engine.generate([[90, 91]], params)[0].token_ids == greedy


def test_shared_uncached_prefix_is_computed_once():
    shared = [(i * 13) % 90 + 33 for i in range(600)]
    prompts = [shared + [40, 41, 42], shared + [50, 51, 52]]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Engine(model="tiny", disable_radix_cache=True) as off:
        expected = [r.token_ids for r in off.generate(prompts, params)]
    with Engine(model="tiny") as engine:
        first, second = engine.generate(prompts, params)
        assert [first.token_ids, second.token_ids] == expected
        # The second waited one step for the first's prefill instead of computing the same 600 tokens.
        assert first.cached_tokens == 0 and second.cached_tokens == 592


def test_a_request_past_its_timeout_fails_clearly_and_releases_what_it_held():
    with Engine(model="tiny", request_timeout=0.5, max_total_tokens=8192) as engine:
        started = time.monotonic()
        slow = engine.generate([list(range(40, 90))], SamplingParams(max_new_tokens=3000, ignore_eos=True))[0]
        assert slow.finish_reason == "timeout" and "--request-timeout 0.5 s" in slow.error
        assert time.monotonic() - started < 5
        quick = engine.generate([list(range(40, 60))], SamplingParams(max_new_tokens=4))[0]
        assert quick.finish_reason == "length" and len(quick.token_ids) == 4
        deadline = time.monotonic() + 10
        while not (engine.flush_cache() and engine.leak_report() == []):  # the cancel lands between two steps
            assert time.monotonic() < deadline, engine.leak_report()
            time.sleep(0.05)
        assert engine.pool_usage()["device"][0] == 0
