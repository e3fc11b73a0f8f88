"""A KV handle's page table through the cache API: whatever the sequence of extend, advance, truncate,
cache_prefix and release (prompts sharing prefixes, so the tree's pages replace a handle's own), the
slots a step reads from the handle (`KVHandle.slots`) are those its pages hold, built afresh from them."""

from __future__ import annotations

import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from hicache.cache.api import KVState
from hicache.cache.build import device_cache
from tests.cache.kv import PAGE, device_pool

SPANS = [list(range(base, base + 2 * PAGE)) for base in (10, 40, 70)]
PROMPTS = [[0], [0, 1], [0, 1, 2]]  # spans each prompt starts with
NEW_TOKENS = 3 * PAGE
# "step": pages for n more tokens and their KV computed, as a scheduler step; "extend": pages alone (a
# speculative step's verify rows).
ACTIONS = ("admit", "step", "step", "extend", "truncate", "cache", "release")
calls = st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 2), st.integers(0, 4 * PAGE)),
                 min_size=10, max_size=60)  # fmt: skip


def sequence(spans: list[int], slot: int) -> list[int]:
    """The prompt (shared spans, then a token of its own) followed by what it generates."""
    prompt = [t for i in spans for t in SPANS[i]] + [200 + slot]
    return prompt + [300 + 20 * slot + i for i in range(NEW_TOKENS)]


@settings(max_examples=100, deadline=None)
@given(calls=calls, prompts=st.lists(st.sampled_from(PROMPTS), min_size=3, max_size=3))
# Two requests compute the same span before either caches it: the second's pages become the tree's.
@example(calls=[("admit", 0, 0), ("admit", 1, 0), ("step", 0, 9), ("step", 1, 9), ("cache", 0, 0), ("cache", 1, 0)],
         prompts=[[0], [0], [0]])  # fmt: skip
def test_a_handles_slots_are_its_pages_slots_whatever_the_calls(calls, prompts):
    cache = device_cache(device_pool(40))
    allocator = cache.pool.allocator
    live: dict[int, tuple] = {}  # slot -> (handle, its sequence)
    for rid, (action, slot, n) in enumerate(calls):
        if action == "admit" and slot not in live:
            tokens = sequence(prompts[slot], slot)
            handle = cache.open(rid, tokens[: len(tokens) - NEW_TOKENS], "")
            if cache.admit(handle, -(-len(tokens) // PAGE)).admitted:
                live[slot] = (handle, tokens)
                event(f"admitted with {handle.kv_len // PAGE} cached pages")
            continue
        if slot not in live:
            continue
        handle, tokens = live[slot]
        if action == "step":
            end = min(handle.kv_len + n, len(tokens))
            cache.extend(handle, end)
            handle.advance(end)
        elif action == "extend":
            cache.extend(handle, min(len(handle.pages) * PAGE + n, len(tokens)))
        elif action == "truncate":
            handle.truncate(max(handle.committed_len, handle.kv_len - n))
        elif action == "cache":  # what it computed: its prompt's pages when done, or at release
            own = list(handle.pages)
            cache.cache_prefix(handle, tokens[: handle.kv_len])
            event(f"the tree's pages replaced its own: {own != handle.pages}")
        elif action == "release":
            cache.release(handle, tokens[: handle.kv_len])
            assert handle.pages == [] and handle.slots(0).numel() == 0
            del live[slot]
        for held, _ in live.values():
            assert held.state is KVState.READY
            assert torch.equal(held.slots(len(held.pages) * PAGE), allocator.slots(held.pages))
            assert torch.equal(held.slots(held.kv_len), allocator.slots(held.pages, held.kv_len))
    for handle, tokens in live.values():
        cache.release(handle, tokens[: handle.kv_len])
    cache.flush()
    assert cache.leak_report() == []
