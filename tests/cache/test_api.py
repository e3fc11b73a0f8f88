"""The cache API over the device tier: a KV handle's life (open -> admit -> extend -> advance ->
cache_prefix -> truncate -> release), admission against the reservations, and a property test that
every page and promise comes back whatever the order of requests' lives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.api import TIERS, KVCache, KVState, PrefixMatch
from hicache.cache.build import device_cache
from hicache.cache.prefix_cache import PrefixCache
from tests.cache.kv import PAGE, assert_kv, device_pool, write_kv

PROMPT = list(range(10, 10 + 3 * PAGE + 2))  # three full pages and a partial one


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE)


def run_prompt(cache: PrefixCache, rid: int, prompt: list[int], new_tokens: int = 2):
    """A whole request through the API, as the scheduler drives it; returns (admission, handle)."""
    handle = cache.open(rid, prompt, "")
    admission = cache.admit(handle, pages_for(len(prompt) + new_tokens))
    assert admission.admitted
    cache.extend(handle, len(prompt))
    write_kv(cache.pool, handle.pages, prompt, start=handle.kv_len)
    handle.advance(len(prompt))
    cache.cache_prefix(handle, prompt)
    tokens = list(prompt)
    for t in range(new_tokens - 1):  # the last sampled token is never computed
        tokens.append(200 + t)
        cache.extend(handle, len(tokens))
        write_kv(cache.pool, handle.pages, tokens, start=handle.kv_len)
        handle.advance(len(tokens))
    return admission, handle, tokens


def test_a_handles_life():
    cache = device_cache(device_pool(16))
    assert isinstance(cache, KVCache)
    handle = cache.open(1, PROMPT, "")
    assert handle.state is KVState.WAITING and handle.pages == [] and handle.kv_len == 0
    admission = cache.admit(handle, pages_for(len(PROMPT) + 4))
    assert admission.admitted and admission.cached == PrefixMatch() and admission.reserved_pages == 5
    assert handle.state is KVState.READY and cache.reserved_pages == 5
    cache.extend(handle, len(PROMPT))
    assert len(handle.pages) == 4 and handle.reserved_pages == 1 and cache.reserved_pages == 1
    write_kv(cache.pool, handle.pages, PROMPT)
    handle.advance(len(PROMPT))
    cache.cache_prefix(handle, PROMPT)
    assert handle.committed_len == 3 * PAGE
    assert handle.lock is not None and handle.lock.lock_ref == 1, "the handle locks its prompt's last node"
    cache.release(handle, PROMPT)
    assert handle.state is KVState.RELEASED and handle.pages == [] and handle.lock is None
    assert cache.reserved_pages == 0
    assert cache.tree.locked_nodes() == []
    assert cache.device.allocator.used_pages == 3, "the three full pages stay cached"
    cache.flush()
    assert cache.leak_report() == []


def test_a_second_request_reuses_the_first_ones_pages():
    cache = device_cache(device_pool(16))
    _, first, _ = run_prompt(cache, 1, PROMPT)
    shared = list(first.pages[:3])
    cache.release(first, PROMPT + [200])
    again = cache.open(2, PROMPT, "")
    admission = cache.admit(again, pages_for(len(PROMPT) + 2))
    assert admission.cached == PrefixMatch(device=3 * PAGE), "device tier: the cached prompt pages were not found"
    assert again.kv_len == 3 * PAGE and again.pages == shared
    assert_kv(cache.pool, again.pages, PROMPT[: 3 * PAGE], "device")
    assert again.cached_tokens_by_tier == dict(zip(TIERS, (3 * PAGE, 0, 0)))
    cache.release(again, PROMPT)
    cache.flush()
    assert cache.leak_report() == []


def test_refused_admission_holds_nothing_and_promises_count():
    cache = device_cache(device_pool(8))
    big = cache.open(1, list(range(20)), "")
    assert cache.admit(big, 6).admitted
    small = cache.open(2, list(range(50, 60)), "")
    refused = cache.admit(small, 3)  # 8 pages, 6 promised: 3 do not fit
    assert not refused.admitted and small.state is KVState.WAITING
    assert small.pages == [] and small.reserved_pages == 0 and cache.tree.locked_nodes() == []
    cache.release(big, [])
    assert cache.admit(small, 3).admitted, "the promise is returned at release"
    cache.release(small, [])
    assert cache.leak_report() == []


def test_extend_within_the_reservation_only():
    cache = device_cache(device_pool(16))
    handle = cache.open(1, PROMPT, "")
    cache.admit(handle, 4)
    cache.extend(handle, 4 * PAGE)
    with pytest.raises(RuntimeError, match="outgrew its reservation"):
        cache.extend(handle, 4 * PAGE + 1)
    with pytest.raises(ValueError):
        handle.advance(4 * PAGE + 1)  # beyond its pages
    handle.advance(PAGE)
    with pytest.raises(ValueError):
        handle.advance(PAGE - 1)  # backwards: that is truncate's job
    cache.release(handle, PROMPT)
    cache.flush()
    assert cache.leak_report() == []


def test_truncate_rolls_back_speculative_tokens():
    cache = device_cache(device_pool(16))
    _, handle, tokens = run_prompt(cache, 1, PROMPT, new_tokens=5)
    pages = list(handle.pages)
    kv_len = handle.kv_len
    with pytest.raises(ValueError):
        handle.truncate(handle.committed_len - 1)  # below what the tree shares
    with pytest.raises(ValueError):
        handle.truncate(kv_len + 1)
    handle.truncate(len(PROMPT))  # reject the decoded tokens
    assert handle.kv_len == len(PROMPT) and handle.pages == pages, "the pages stay the request's"
    tokens = PROMPT + [300, 301]  # other tokens replace them
    cache.extend(handle, len(tokens))
    write_kv(cache.pool, handle.pages, tokens, start=handle.kv_len)
    handle.advance(len(tokens))
    assert_kv(cache.pool, handle.pages, tokens, "device")
    cache.release(handle, tokens)
    again = cache.open(2, tokens + [9, 9, 9], "")
    assert cache.admit(again, 6).cached.device == 4 * PAGE, "the replacing tokens are what got cached"
    with pytest.raises(ValueError):
        cache.release(again, [])  # fewer tokens than it has computed: the cache could not keep them
    cache.release(again, again.prompt)
    cache.flush()
    assert cache.leak_report() == []


def test_release_in_any_state_and_only_once():
    cache = device_cache(device_pool(16))
    waiting = cache.open(1, PROMPT, "")
    cache.release(waiting, PROMPT)  # aborted before admission
    assert waiting.state is KVState.RELEASED
    with pytest.raises(RuntimeError):
        cache.release(waiting, PROMPT)
    with pytest.raises(RuntimeError):
        cache.admit(waiting, 4)
    with pytest.raises(ValueError):
        waiting.truncate(0)
    assert cache.leak_report() == []


def test_radix_cache_off_reserves_without_caching():
    cache = device_cache(device_pool(16), radix=False)
    _, first, tokens = run_prompt(cache, 1, PROMPT)
    cache.release(first, tokens)
    second = cache.open(2, PROMPT, "")
    assert cache.admit(second, 5).cached == PrefixMatch(), "nothing is cached with the radix cache off"
    cache.release(second, [])
    assert cache.device.allocator.used_pages == 0 and cache.leak_report() == []


def test_namespaces_never_share():
    cache = device_cache(device_pool(16))
    _, first, tokens = run_prompt(cache, 1, PROMPT)
    cache.release(first, tokens)
    other = cache.open(2, PROMPT, "salt")
    assert cache.admit(other, 5).cached == PrefixMatch()
    cache.release(other, [])


# A request's life as the property test drives it: a prompt from a small alphabet (so prefixes are
# shared), new tokens, and how far it gets before it is released (aborted while waiting, mid-prefill,
# or finished), with an optional rollback.
lives = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2), min_size=1, max_size=5 * PAGE),
        st.integers(1, 6),
        st.sampled_from(["waiting", "prefill", "finished", "truncated"]),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(lives=lives, concurrent=st.integers(1, 4))
def test_every_page_and_promise_comes_back(lives, concurrent):
    cache = device_cache(device_pool(24))
    open_ = []
    for rid, (prompt, new, end) in enumerate(lives):
        handle = cache.open(rid, prompt, "")
        if end != "waiting" and cache.admit(handle, pages_for(len(prompt) + new)).admitted:
            tokens = list(prompt)
            upto = len(prompt) if end == "prefill" else len(prompt) + new - 1
            while len(tokens) < upto:
                tokens.append(100 + len(tokens))
            cache.extend(handle, max(upto, handle.kv_len))
            write_kv(cache.pool, handle.pages, tokens, start=handle.kv_len)
            handle.advance(max(upto, handle.kv_len))
            assert_kv(cache.pool, handle.pages, tokens[: handle.kv_len], "device")
            if end == "truncated":
                handle.truncate(max(handle.committed_len, min(len(prompt), handle.kv_len)))
            open_.append((handle, tokens))
        else:
            open_.append((handle, []))
        promised = sum(h.reserved_pages for h, _ in open_ if h.state is KVState.READY)
        assert cache.reserved_pages == promised
        while len(open_) >= concurrent:
            handle, tokens = open_.pop(0)
            cache.release(handle, tokens)
    for handle, tokens in open_:
        cache.release(handle, tokens)
    assert cache.reserved_pages == 0 and cache.tree.locked_nodes() == []
    cache.flush()
    assert cache.leak_report() == []
