"""The cache API under any sequence of calls: prompts looked up (changing nothing), requests opened (slots 1
and 2 with retention hints that lapse a few calls on, docs/DESIGN.md, "retention hints"), admitted
(computing what the tree lacks) or reserved (their KV landing from outside while the host part
restores), completed, failed and released in any order, with prefixes pushed to host memory between
them and some restores failing. Whatever the order, every page served holds its tokens' KV, the
promises add up at every step, and at the end every page and lock is back."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hicache.cache.api import KVState, RestoreState
from hicache.cache.build import hierarchical_cache
from hicache.cache.prefix_cache import PrefixCache
from hicache.cache.retention import Retention
from hicache.config import HiCacheConfig
from tests.cache.kv import PAGE, assert_kv, device_pool, one_rank, write_kv
from tests.cache.test_hierarchical import settle
from tests.cache.test_lookup import dump
from tests.cache.test_reserve import restore_done

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

SPANS = [list(range(base, base + 2 * PAGE)) for base in (10, 40, 70)]  # prompts share them as prefixes
ACTIONS = ("open", "lookup", "admit", "reserve", "finish", "fail", "release", "evict")

PREFIXES = [[0], [0, 1], [0, 1, 2], [1], [1, 2]]
calls = st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 2), st.sampled_from(PREFIXES)),
                 min_size=12, max_size=40)  # fmt: skip


def prompt_of(spans: list[int], slot: int) -> list[int]:
    return [t for i in spans for t in SPANS[i]] + [200 + slot]


@settings(max_examples=100, deadline=None)
@given(calls=calls, failing=st.booleans())
def test_any_sequence_of_calls_returns_every_page_and_lock(calls, failing):
    config = HiCacheConfig(enable_hierarchical_cache=True, hicache_load_back_threshold=PAGE)
    cache = hierarchical_cache(device_pool(24), config, one_rank(), "test-model")
    if failing:  # every other layer copy fails, so every load of more than one layer does
        real, copies = cache.lower.host.host.load_layer, itertools.count()

        def flaky(pool, layer, host_pages, device_pages):
            if next(copies) % 2:
                raise RuntimeError("injected copy failure")
            real(pool, layer, host_pages, device_pages)

        cache.lower.host.host.load_layer = flaky
    handles: dict[int, tuple] = {}  # slot -> (handle, prompt)
    try:
        for rid, (action, slot, spans) in enumerate(calls):
            if action == "lookup":
                before = dump(cache.tree)
                cache.lookup(prompt_of(spans, slot), "")
                assert dump(cache.tree) == before, "a lookup changed the tree"
            if slot not in handles and action in ("open", "admit", "reserve"):
                hint = Retention(priority=slot, seconds=1.0, since=rid / 2)  # a call is half a second
                handles[slot] = (cache.open(rid, prompt_of(spans, slot), "", hint), prompt_of(spans, slot))
            handle, prompt = handles.get(slot, (None, []))
            state = handle.state if handle is not None else None
            if action == "admit" and state is KVState.WAITING:
                if cache.admit(handle, -(-len(prompt) // PAGE) + 1).admitted:
                    compute(cache, handle, prompt)
            elif action == "reserve" and state is KVState.WAITING:
                admission = cache.reserve(handle, -(-len(prompt) // PAGE) + 1)
                event(f"reserved with a host part: {admission.cached.host > 0}")
            elif action == "finish" and state is KVState.RESERVED:
                landed = restore_done(cache, handle) is RestoreState.LANDED
                event(f"finished: restore landed {landed}")
                if landed:
                    write_kv(cache.pool, handle.pages, prompt, start=handle.kv_len)  # the KV from outside
                    cache.complete(handle)
                    assert_kv(cache.pool, handle.pages, prompt, "device + restore + outside")
                else:
                    cache.fail(handle)
            elif action == "fail" and state in (KVState.WAITING, KVState.RESERVED):
                cache.fail(handle)
            elif action == "release" and handle is not None:
                cache.release(handle, prompt if state is KVState.READY else prompt[: handle.kv_len])
            elif action == "evict":
                settle(cache)
                cache.tree.evict(8)
            if handle is not None and handle.state is KVState.RELEASED:
                del handles[slot]
            promising = (KVState.READY, KVState.RESERVED)
            promised = sum(h.reserved_pages for h, _ in handles.values() if h.state in promising)
            assert cache.reserved_pages == promised
            for h, _ in handles.values():  # the slots a step reads from a handle are its pages' slots
                assert torch.equal(h.slots(len(h.pages) * PAGE), cache.pool.allocator.slots(h.pages))
        for handle, prompt in handles.values():
            if handle.state is KVState.READY:
                cache.release(handle, prompt)
            else:
                restore_done(cache, handle)
                cache.fail(handle)
        settle(cache)
        assert cache.tree.locked_nodes() == [] and cache.reserved_pages == 0
        cache.flush()
        assert cache.leak_report() == []
    finally:
        cache.shutdown()


def compute(cache: PrefixCache, handle, prompt: list[int]) -> None:
    """What the scheduler does with an admitted handle: one step over its prompt, waiting for its loads;
    a load that did not land sends it back (released, its prefix recomputed later), as
    Scheduler._recompute_failed_loads does."""
    cache.extend(handle, len(prompt))
    wait = cache.before_layer()
    for layer in range(cache.pool.num_layers if wait is not None else 0):
        wait(layer)
    failed = cache.failed_loads()
    if failed and not failed.pages.isdisjoint(handle.pages):
        cache.release(handle, prompt[: handle.kv_len])
        cache.drop_failed_loads(failed, 1)
        return
    if failed:
        cache.drop_failed_loads(failed, 0)
    assert_kv(cache.pool, handle.pages[: handle.kv_len // PAGE], prompt[: handle.kv_len], "device / host")
    write_kv(cache.pool, handle.pages, prompt, start=handle.kv_len)
    handle.advance(len(prompt))
    cache.cache_prefix(handle, prompt)
