"""The cache-aware policy's arithmetic (hicache/router/scoring.py) and the index read it relies on
(BlockIndex.prefix_tiers): with equal loads the server holding more of the prompt wins, a faster tier
beats a slower one, with nothing cached the least loaded wins, and a prompt's cached prefix is read the
way a server's match reads it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hicache.cache import MEDIA
from hicache.events import BlockIndex, prompt_hashes
from hicache.events.wire import MEDIUM_OF, BlockStored
from hicache.router.scoring import TIER_WEIGHTS, Load, cheapest, cost, saved_tokens

PAGE = 16
tiers = st.lists(st.sampled_from(MEDIA), max_size=40)
loads = st.builds(Load, st.integers(0, 8), st.integers(0, 4000))


@given(tiers)
def test_a_cached_prefix_saves_at_most_its_tokens_and_device_pages_save_all(prefix):
    saved = saved_tokens(prefix, PAGE)
    assert min(TIER_WEIGHTS.values()) * PAGE * len(prefix) <= saved <= PAGE * len(prefix)
    assert saved_tokens(["device"] * len(prefix), PAGE) == PAGE * len(prefix)
    assert TIER_WEIGHTS["device"] > TIER_WEIGHTS["host"] > TIER_WEIGHTS["storage"] > 0


@given(st.lists(tiers, min_size=2, max_size=4), loads, st.integers(1, 1000))
def test_with_equal_loads_the_server_holding_most_of_the_prompt_wins(prefixes, load, extra):
    prompt = PAGE * 40 + extra
    costs = [cost(prompt, saved_tokens(p, PAGE), load) for p in prefixes]
    best = cheapest(costs, [load] * len(prefixes), [-1] * len(prefixes))
    assert saved_tokens(prefixes[best], PAGE) == max(saved_tokens(p, PAGE) for p in prefixes)


@given(st.integers(1, 40), st.sampled_from([("device", "host"), ("host", "storage"), ("device", "storage")]))
def test_the_same_prefix_on_a_faster_tier_wins(pages, pair):
    fast, slow = pair
    costs = [cost(PAGE * 41, saved_tokens([slow] * pages, PAGE), Load()),
             cost(PAGE * 41, saved_tokens([fast] * pages, PAGE), Load())]  # fmt: skip
    assert cheapest(costs, [Load(), Load()], [-1, -1]) == 1


@given(st.lists(loads, min_size=2, max_size=4), st.integers(1, 4000))
def test_with_nothing_cached_the_least_loaded_wins(server_loads, prompt):
    costs = [cost(prompt, 0.0, load) for load in server_loads]
    best = server_loads[cheapest(costs, server_loads, list(range(len(server_loads))))]
    assert best.tokens == min(load.tokens for load in server_loads)
    assert best.requests == min(load.requests for load in server_loads if load.tokens == best.tokens)


@given(st.integers(2, 5))
def test_ties_go_round_the_servers(n):
    """Nothing cached, nothing in flight: the one picked least recently, so n requests reach n servers."""
    last = [-1] * n
    picked = []
    for request in range(n):
        best = cheapest([100.0] * n, [Load()] * n, last)
        last[best] = request
        picked.append(best)
    assert sorted(picked) == list(range(n))


@given(st.lists(st.sets(st.integers(0, 11)), min_size=3, max_size=3), st.integers(0, 12))
def test_prefix_tiers_read_a_prompt_the_way_a_servers_match_does(held, length):
    """Page i is on tier t when i is in held[t]: each leading page held anywhere counts once, at the
    fastest tier holding it, and the walk ends at the first page held nowhere."""
    page = 4
    tokens = [i for i in range(length) for _ in range(page)]
    hashes = prompt_hashes(tokens, page)
    index = BlockIndex()
    for i in range(length):  # as a server stores them: each page after the one before it
        for medium, pages in zip(MEDIA, held):
            if i in pages:
                parent = hashes[i - 1] if i else None
                index.apply(BlockStored([hashes[i]], parent, tokens[i * page : (i + 1) * page], page, None,
                                        MEDIUM_OF[medium], None))  # fmt: skip
    got = index.prefix_tiers(hashes)
    anywhere = set().union(*held)
    expected_len = next((i for i in range(length) if i not in anywhere), length)
    assert len(got) == expected_len
    for i, tier in enumerate(got):
        assert tier == next(m for m, pages in zip(MEDIA, held) if i in pages)
    assert got.count("device") >= index.match(hashes)["device"]
