"""KV events: after a workload and a flush, a subscriber's view of a server's pages agrees per tier with
the server's own counts and its store's objects, and names every page by the same chain the server
hashes (the events carry what it needs: token ids, parents, the salt); a subscriber that misses
messages, or joins late, or outlives the server, catches up to the same view; the same prompt under two
cache_salts names different pages; with the flag off nothing is published. One tiny engine with the
host and storage tiers serves the module."""

import dataclasses
import re
import time

import pytest

from hicache import Engine, SamplingParams
from hicache.cache import KVEventRecorder
from hicache.config import EngineConfig, HiCacheConfig
from hicache.errors import UserError
from hicache.events import KVEventPublisher, KVEventSubscriber, prompt_hashes
from tests.conversations import make_conversations, run_turns
from tests.disagg.pd import free_ports, scheduler_of
from tests.page_bytes import stored_page_bytes

PAGE = 16
CONVS = make_conversations(num_groups=2, per_group=2, system_len=200, question_len=30)
TURNS = 3
NEW = 8
DEVICE_TOKENS = 768  # below the working set: pages move to the host tier and back
STORED = re.compile(r"^([0-9a-f]{64})_")


def drain(sub: KVEventSubscriber, frames: list | None = None) -> None:
    """Take in what the publisher sent (it sends within milliseconds of a step) until it goes quiet;
    with `frames`, collect the raw messages instead of applying them."""
    while messages := sub.receive(timeout_ms=500):
        if frames is None:
            for message in messages:
                sub.handle(message)
        else:
            frames.extend(messages)


def in_step(engine: Engine, subs: list[KVEventSubscriber]) -> None:
    """Serve small requests until every subscriber has taken in a batch: a SUB socket gets nothing
    sent before it has connected."""
    for i in range(20):
        engine.generate([list(range(40 + i, 80 + i))], SamplingParams(max_new_tokens=2))
        for sub in subs:
            drain(sub)
        if all(sub.seq is not None for sub in subs):
            return
    raise AssertionError("a subscriber never got a batch")


def stored_hashes(root) -> set[bytes]:
    """The page hashes the store holds objects for (file backend: <root>/<fan-out>/<hash>_<namespace>)."""
    return {bytes.fromhex(m.group(1)) for p in root.rglob("*") if p.is_file() and (m := STORED.match(p.name))}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A workload (two tenants) on one server, watched by a subscriber that gets every message and one
    whose messages the test holds back: the server's counts after the workload and after a flush."""
    store = tmp_path_factory.mktemp("store")
    endpoint = f"tcp://127.0.0.1:{free_ports(2)}"
    cfg = HiCacheConfig(
        enable_hierarchical_cache=True, hicache_write_policy="write_through",
        hicache_storage_backend="file", hicache_storage_dir=str(store),
    )  # fmt: skip
    whole, lossy = KVEventSubscriber(endpoint), KVEventSubscriber(endpoint)
    held: list = []  # the lossy subscriber's messages, held back by the test
    out = {}
    events_on = {"kv_events_endpoint": endpoint}
    with Engine(model="tiny", page_size=PAGE, max_total_tokens=DEVICE_TOKENS, hicache=cfg, **events_on) as engine:
        in_step(engine, [whole, lossy])  # before the messages the lossy one will miss
        run_turns(engine, CONVS, TURNS, NEW, cache_salt="tenant-a")
        run_turns(engine, CONVS[:1], 1, NEW)  # unsalted
        drain(whole)
        drain(lossy, held)
        out["workload"] = (engine.snapshot().pool_usage, whole.index.counts())
        out["matches"] = {salt: whole.index.match(prompt_hashes(CONVS[0]["system"], PAGE, salt))
                          for salt in ("tenant-a", "tenant-b")}  # fmt: skip
        out["held"] = len(held)
        for i, message in enumerate(held):  # while the server is up to answer its snapshot requests
            if i % 3 != 1:  # every third message lost in transit
                lossy.handle(message)
        out["lossy"] = (lossy.replays, lossy.seq, lossy.index.counts(), lossy.index.pages == whole.index.pages)
        out["whole_seq"] = whole.seq
        late = KVEventSubscriber(endpoint)  # joins after the workload: the replay is the server's state
        late.catch_up()
        out["late"] = late.index.pages == whole.index.pages and late.index.chain_hashes() == whole.index.chain_hashes()
        late.close()
        assert engine.flush_cache()
        drain(whole)
        out["flushed"] = (engine.snapshot().pool_usage, whole.index.counts())
        out["storage_pages"] = set(whole.index.pages["storage"])
        out["chains_are_hashes"] = whole.index.chain_hashes() == whole.index.pages
    out["store"] = stored_hashes(store)
    # A new server on the same store: the salted chain its prefetch looks up is the one the first put.
    restart = dataclasses.replace(
        cfg, hicache_storage_prefetch_threshold=PAGE, hicache_storage_prefetch_policy="wait_complete"
    )
    prompt = CONVS[0]["system"] + list(range(40, 60))
    with Engine(model="tiny", page_size=PAGE, hicache=restart, **events_on) as engine:
        params = SamplingParams(max_new_tokens=2)
        out["restart"] = {salt: engine.generate([prompt], params, cache_salt=salt)[0]
                          for salt in ("tenant-b", "tenant-a")}  # fmt: skip
        replays = out["replays_before_restart"] = whole.replays
        for i in range(20):  # the new life's seqs run on from the old one's: a gap, so a replay
            engine.generate([list(range(100 + i, 140 + i))], params)
            drain(whole)
            if whole.replays > replays:
                break
        out["after_restart"] = (whole.replays - replays, engine.snapshot().pool_usage, whole.index.counts())
    out["whole"] = whole
    yield out
    whole.close()
    lossy.close()


@pytest.mark.slow
def test_events_agree_with_the_servers_counts_per_tier(served):
    usage, counts = served["workload"]
    assert counts["device"] > 0 and counts["host"] > 0 and counts["storage"] > 0, counts
    assert counts["device"] * PAGE == usage["device"][0]
    assert counts["host"] * PAGE == usage["host"][0]
    usage, counts = served["flushed"]
    assert counts["device"] == counts["host"] == 0 and usage["device"][0] == usage["host"][0] == 0
    # Storage keeps its objects through a flush: the events name exactly the pages the store holds.
    assert served["storage_pages"] == served["store"]
    assert served["replays_before_restart"] == 1  # only to start: it missed nothing


@pytest.mark.slow
def test_the_events_name_pages_by_the_chain_the_server_hashes(served):
    """hicache's page hashes are its content chain: a subscriber that rebuilt the chain from each event's
    token ids, parent and salt names every page as the server does; one that joined late agrees."""
    assert served["chains_are_hashes"]
    assert served["late"]


@pytest.mark.slow
def test_a_subscriber_that_outlives_its_server_follows_the_next_one(served):
    """A server restarted on the same endpoint: the subscriber sees a gap (the seqs run on), asks, and
    gets the new server's state, which replaces the old one's (its storage pages included: the new
    server reports only what it puts or reads itself)."""
    replays, usage, counts = served["after_restart"]
    assert replays == 1
    assert counts["device"] * PAGE == usage["device"][0] > 0 and counts["host"] * PAGE == usage["host"][0]


@pytest.mark.slow
def test_a_subscriber_that_misses_messages_catches_up(served):
    replays, seq, counts, same_pages = served["lossy"]
    assert served["held"] > 6
    assert replays == 2  # the first to start, then one for the first gap: its replay covers the rest
    assert seq == served["whole_seq"]
    assert counts == served["workload"][1] and same_pages


def test_a_prompt_matches_only_under_its_own_salt(served):
    """A router hashes the prompt itself: tenant-a's shared system prompt is held (it was stored on
    every tier it reached), tenant-b's same tokens name other pages, held nowhere."""
    matches = served["matches"]
    full_pages = len(CONVS[0]["system"]) // PAGE
    assert max(matches["tenant-a"].values()) == full_pages, matches
    assert matches["tenant-b"] == {"device": 0, "host": 0, "storage": 0}


def test_with_the_flag_off_nothing_is_recorded_or_published():
    with Engine(model="tiny", page_size=PAGE) as engine:
        engine.generate([list(range(40, 100))], SamplingParams(max_new_tokens=4))
        scheduler = scheduler_of(engine)
        assert scheduler.kv_events is None and not scheduler.cache.events.enabled
        assert engine.call_in_loop(scheduler.cache.events.drain) == []


def test_after_a_restart_storage_serves_a_tenant_its_own_pages_only(served):
    tenant_a, tenant_b = served["restart"]["tenant-a"], served["restart"]["tenant-b"]
    assert tenant_b.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": 0}
    assert tenant_a.cached_tokens_by_tier["storage"] == len(CONVS[0]["system"]) // PAGE * PAGE
    assert tenant_a.token_ids == tenant_b.token_ids  # the storage hit changed no token


def test_an_endpoint_taken_or_malformed_is_a_clear_error():
    recorder = KVEventRecorder(PAGE)
    with pytest.raises(UserError, match="tcp://host:port"):
        KVEventPublisher("127.0.0.1:5557", recorder)
    endpoint = f"tcp://127.0.0.1:{free_ports(2)}"
    first = KVEventPublisher(endpoint, recorder)
    try:
        with pytest.raises(UserError, match="cannot bind"):
            KVEventPublisher(endpoint, KVEventRecorder(PAGE))
    finally:
        first.close()
    assert not recorder.enabled  # closed: the cache records nothing more


@pytest.mark.slow
@pytest.mark.dtype_sensitive  # a store cap or byte count in the dtype `--dtype auto` takes here
def test_what_a_capped_store_evicts_is_removed_from_storage_in_the_events(tmp_path):
    """The file store's own cap evicts objects during this server's puts: the events remove their pages,
    so the subscriber's storage pages stay exactly the store's (without the reports they kept every page
    ever put)."""
    store = tmp_path / "store"
    endpoint = f"tcp://127.0.0.1:{free_ports(2)}"
    # One page's object in the dtype this engine runs here (bf16 or float32: the CPU's, or HICACHE_CPU_BF16's)
    page_object = stored_page_bytes(EngineConfig(model="tiny", page_size=PAGE))
    cfg = HiCacheConfig(
        enable_hierarchical_cache=True, hicache_write_policy="write_through", hicache_storage_backend="file",
        hicache_storage_dir=str(store), hicache_storage_max_bytes=40 * page_object,
    )  # fmt: skip
    sub = KVEventSubscriber(endpoint)
    try:
        with Engine(model="tiny", page_size=PAGE, hicache=cfg, kv_events_endpoint=endpoint) as engine:
            in_step(engine, [sub])
            run_turns(engine, CONVS, 2, NEW)  # about twice what the cap holds
            # Puts run on the storage thread and a put's evictions are reported at the step after it:
            # repeat one small request (stored by its first run, so nothing new to put) until a step has
            # followed the last put. Without the reports the pages never match and the loop runs out.
            for _ in range(50):
                in_step(engine, [sub])
                if sub.index.pages["storage"] == stored_hashes(store):
                    break
                time.sleep(0.05)
            evicted = engine.snapshot().cache.storage.store.evicted_objects
        assert evicted > 0, "the cap never evicted: the test would prove nothing"
        assert sub.index.pages["storage"] == stored_hashes(store)
        assert {p.stat().st_size for p in store.rglob("*") if STORED.match(p.name)} == {page_object}
    finally:
        sub.close()
