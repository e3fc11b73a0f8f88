"""A host -> device load that fails or times out degrades to a recompute (hicache/cache/failed_loads.py):
the batch goes on, the requests that needed the load recompute from the last good page, outputs equal
the cache-off run token for token, the failure is counted, and nothing leaks: a flush gives every
device page back, whatever else the step that needed the load loaded below it. No page the load never
wrote is served later, not even from the part of its node a later match split off."""

import itertools
import time

import pytest

from hicache import Engine
from hicache.cache.build import hierarchical_cache
from hicache.cache.prefix_cache import PrefixCache
from hicache.cache.radix import RadixTree
from hicache.config import DebugConfig, HiCacheConfig, ParallelConfig
from hicache.mem.host_pool import HostKVPool
from tests.cache.kv import PAGE, device_pool, one_rank
from tests.cache.test_hicache import assert_clean
from tests.cache.test_hierarchical import serve, settle
from tests.conversations import make_conversations, run_turns

CONVS = make_conversations(num_groups=2, per_group=3, system_len=300, question_len=40)
TURNS = 3
NEW = 16
DEVICE_TOKENS = 1024  # the conversations' working set is ~3x this: host hits every turn


def tokens(turns):
    return [[r.token_ids for r in results] for results in turns]


@pytest.fixture(scope="module")
def reference():
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        return tokens(run_turns(engine, CONVS, TURNS, NEW))


def cached_engine(debug: DebugConfig, timeout: float = 60.0, tp: int = 1, pp: int = 1) -> Engine:
    cfg = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_transfer_timeout=timeout)
    return Engine(model="tiny", max_total_tokens=DEVICE_TOKENS, hicache=cfg, debug=debug,
                  parallel=ParallelConfig(tp_size=tp, pp_size=pp))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_failed_loads_recompute_with_equal_outputs(reference, rate):
    with cached_engine(DebugConfig(debug_load_fail_rate=rate)) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        stats = engine.cache_stats().host
        assert tokens(turns) == reference
        assert stats.load_pages > 0 and stats.load_failed_pages > 0 and stats.load_failed_requests > 0
        if rate == 1.0:  # every load failed: nothing came from host memory
            assert stats.load_failed_pages == stats.load_pages
            assert all(r.cached_tokens_by_tier["host"] == 0 for results in turns for r in results)
        else:
            assert stats.load_failed_pages < stats.load_pages
        assert_clean(engine)


@pytest.mark.slow
def test_loads_that_time_out_recompute_and_their_pages_wait_for_the_copy(reference, monkeypatch):
    # The first loads' layers take 150 ms each to copy; a layer's attention waits at most 50 ms.
    slow, calls = HostKVPool.load_layer, itertools.count()

    def stuck(self, *args, **kwargs):
        if next(calls) < 12:
            time.sleep(0.15)
        slow(self, *args, **kwargs)

    monkeypatch.setattr(HostKVPool, "load_layer", stuck)
    with cached_engine(DebugConfig(), timeout=0.05) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        stats = engine.cache_stats().host
        assert tokens(turns) == reference
        assert stats.load_timed_out_pages > 0 and stats.load_failed_requests > 0
        time.sleep(1.0)  # the late copies finish; their pages were kept out of the pool until then
        assert_clean(engine)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_ranks_that_fail_different_loads_agree(reference, tp, pp):
    """Each rank draws its own failures: a load that failed on one rank is failed on all, so the ranks
    recompute the same requests (a divergence would fail the run). Under PP a later stage's failed load
    degrades like the first stage's instead of ending its rank: the stages hold different layers of the
    same pages, and all of them are settled together after the forward."""
    with cached_engine(DebugConfig(debug_load_fail_rate=0.4), tp=tp, pp=pp) as engine:
        turns = run_turns(engine, CONVS, TURNS, NEW)
        stats = engine.cache_stats().host
        assert tokens(turns) == reference  # the single-rank cache-off answers (every TP size gives them)
        assert stats.load_failed_pages > 0
        assert_clean(engine)


# Agents in groups sharing a system prompt: one step loads a group's prefix back for one agent and, below
# it, the histories of the others, so a failed load has loads that landed nested under it.
AGENTS = make_conversations(num_groups=4, per_group=4, system_len=300, question_len=40)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_flush_after_failed_loads_leaves_no_device_page_held(tp):
    """Issue 27: the device pool lost pages for good, a few more with every failed load."""
    with cached_engine(DebugConfig(debug_load_fail_rate=0.2), tp=tp) as engine:
        run_turns(engine, AGENTS, 4, NEW)
        assert engine.cache_stats().host.load_failed_requests > 0
        assert_clean(engine)


SYSTEM = list(range(10, 10 + 2 * PAGE))  # two pages two agents share
FIRST = SYSTEM + list(range(100, 100 + 2 * PAGE)) + [1]
SECOND = SYSTEM + list(range(200, 200 + 2 * PAGE)) + [1]
THIRD = SYSTEM + list(range(300, 300 + 2 * PAGE)) + [1]


def small_cache() -> PrefixCache:
    cfg = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_load_back_threshold=PAGE)
    return hierarchical_cache(device_pool(16), cfg, one_rank(), "test-model")


def only_host(cache: PrefixCache, *prompts: list[int]) -> None:
    """Serve `prompts`, back them up and push them off the device."""
    for rid, prompt in enumerate(prompts):
        serve(cache, rid, prompt)
    settle(cache)
    cache.device.evict_all()


def fail_the_next_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next host -> device load issued fails at its first layer; the loads after it land."""
    copy, doomed = HostKVPool.load_layer, []

    def load_layer(self, device, layer, host_pages, device_pages, first_layer=0):
        if not doomed:
            doomed.append(device_pages)  # the first load to copy a layer (loads copy one after another)
        if device_pages is doomed[0]:
            raise RuntimeError("injected: this load fails")
        copy(self, device, layer, host_pages, device_pages, first_layer)

    monkeypatch.setattr(HostKVPool, "load_layer", load_layer)


def step_recomputing(cache: PrefixCache, prompts: list[list[int]]) -> None:
    """Admit `prompts` in one step, every one of them holding a page of the first load, which fails; then
    what the scheduler does after the forward: the requests go back to waiting (released), and the cache takes
    the failed load's pages back."""
    handles = [cache.open(100 + i, prompt, "") for i, prompt in enumerate(prompts)]
    for handle, prompt in zip(handles, prompts):
        assert cache.admit(handle, -(-len(prompt) // PAGE)).admitted
    wait = cache.before_layer()
    for layer in range(cache.pool.num_layers) if wait else ():
        wait(layer)
    failed = cache.failed_loads()
    assert all(not failed.pages.isdisjoint(handle.pages) for handle in handles)
    for handle in handles:
        cache.release(handle, handle.prompt[: handle.kv_len])
    cache.drop_failed_loads(failed, len(handles))


def assert_flushed_clean(cache: PrefixCache) -> None:
    cache.flush()
    assert cache.leak_report() == []
    assert cache.usage()["device"][0] == 0


def test_a_load_that_lands_below_a_failed_one_gives_its_pages_back(monkeypatch: pytest.MonkeyPatch):
    """The first request loads the shared prefix and its own history, the second (the same step) only
    its own history below that prefix: the first load fails, the second lands, and both recompute."""
    cache = small_cache()
    only_host(cache, FIRST, SECOND)
    fail_the_next_load(monkeypatch)
    step_recomputing(cache, [FIRST, SECOND])
    serve(cache, 2, SECOND)  # from the host again, its KV checked
    assert_flushed_clean(cache)


def test_the_part_of_a_failed_load_a_later_match_split_off_is_not_served(monkeypatch: pytest.MonkeyPatch):
    """The first request loads one node (the shared prefix and its history); the second shares only the
    prefix, so its match splits that node. The load fails: a third request sharing the prefix later
    must not read the split-off part's pages, which hold another prompt's KV."""
    cache = small_cache()
    only_host(cache, FIRST)
    only_host(cache, list(range(500, 500 + 4 * PAGE)) + [1])  # its KV stays in the pages the load will get
    fail_the_next_load(monkeypatch)
    step_recomputing(cache, [FIRST, SECOND])
    serve(cache, 2, THIRD)  # its cached prefix's KV checked
    assert_flushed_clean(cache)


def _chain(tree: RadixTree, lengths: list[int]) -> list:
    """A path of nodes of `lengths` pages (4 tokens each) under the root, on the device (pages 1, 2,
    ... in order) and backed up to the host."""
    tokens, nodes = [], []
    for n in lengths:
        tokens += range(len(tokens), len(tokens) + 4 * n)
        tree.insert(tokens, list(range(1, len(tokens) // 4 + 1)))
        node = tree.match_prefix(tokens).last_node
        node.host_pages = [100 + p for p in node.device_pages]
        nodes.append(node)
    return nodes


def test_detach_device_takes_descendants_first_and_spares_locked_nodes():
    tree = RadixTree(page_size=4, on_device_free=lambda pages: None)
    a, b, c = _chain(tree, [1, 2, 1])
    tree.lock(c)
    assert tree.detach_device([b]) == []  # c is locked, so b (its ancestor) keeps its pages too
    tree.unlock(c)
    before = tree.evictable_pages
    taken = tree.detach_device([b])
    assert sorted(taken) == [2, 3, 4] and b.device_pages is None and c.device_pages is None
    assert a.on_device and tree.evictable_pages == before - 3
    assert tree.match_prefix(list(range(16))).device_pages == a.device_pages
