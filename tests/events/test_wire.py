"""KV events in vLLM's wire format, without an engine: what hicache sends decodes with vLLM's schema (a
msgspec schema written here from vLLM's documented fields, and vLLM's own classes where vLLM is
installed); what vLLM sends (today's map-shaped events and the array-shaped ones of older releases)
decodes in hicache's subscriber, whose index finds a prompt's pages on a server that names them by
hashes of its own; the state a publisher replays rebuilds its index exactly; and the replay protocol
answers from the buffer, or with the state where the buffer does not reach back."""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.radix import RadixTree
from hicache.events import BlockIndex, KVEventPublisher, KVEventSubscriber, prompt_hashes
from hicache.events import publisher as publisher_module
from hicache.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_payload,
    encode_payload,
    wire_events,
)
from tests.disagg.pd import free_ports

PAGE = 4


# vLLM's schema (vllm/distributed/kv_events.py, 0.32): the batch an array, each event a map tagged by
# "type"; fields without a default are required. Written from its documented fields, not imported.
class VllmEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


Hash = bytes | int
# (name, type[, default]) in vLLM's order: the required fields first
VllmStored = msgspec.defstruct(
    "VllmStored",
    [("block_hashes", list[Hash]), ("parent_block_hash", Hash | None), ("token_ids", list[int]),
     ("block_size", int), ("lora_id", int | None), ("medium", str | None), ("lora_name", str | None),
     ("extra_keys", list[tuple[Any, ...] | None] | None, None), ("group_idx", int | None, None),
     ("kv_cache_spec_kind", str | None, None), ("locality", str | None, None)],
    bases=(VllmEvent,), tag="BlockStored",
)  # fmt: skip


class VllmRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmStored | VllmRemoved | VllmCleared]
    data_parallel_rank: int | None = None


# Before vLLM's map-shaped events, every event was an array too: [type, fields in order].
class OldVllmStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldVllmRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]


class OldVllmBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OldVllmStored | OldVllmRemoved]


def tree_events(prompts: list[tuple[list[int], str]]) -> list:
    """What a tree records caching `prompts` (tokens, cache_salt), as the publisher sends it."""
    tree = RadixTree(PAGE, on_device_free=lambda pages: None)
    tree.events.enabled = True
    pages = iter(range(10**6))
    for tokens, salt in prompts:
        tree.insert(tokens, [next(pages) for _ in range(len(tokens) // PAGE)], namespace=salt)
    held: dict = {"device": set(), "host": set(), "storage": set()}
    return [out for event in tree.events.drain() for out in wire_events(event, PAGE, held)]


def test_hicache_batches_decode_with_vllms_schema():
    shared = [5, 6, 7, 8] * 2
    events = tree_events([(shared + [1, 2, 3, 4], ""), (shared + [9, 9, 9, 9], ""), (shared, "tenant")])
    events += [BlockRemoved([events[0].block_hashes[0]], "GPU"), AllBlocksCleared()]
    batch = msgspec.msgpack.decode(encode_payload(KVEventBatch(12.5, events, 0)), type=VllmBatch)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    first, branch, salted, removed, cleared = batch.events
    assert isinstance(first, VllmStored) and first.block_size == PAGE and first.medium == "GPU"
    assert first.parent_block_hash is None and first.token_ids == shared + [1, 2, 3, 4]
    assert len(first.block_hashes) == 3 and all(len(h) == 32 for h in first.block_hashes)
    assert branch.parent_block_hash == first.block_hashes[1] and branch.token_ids == [9, 9, 9, 9]
    assert salted.extra_keys == [("tenant",), None] and salted.block_hashes[0] != first.block_hashes[0]
    assert isinstance(removed, VllmRemoved) and removed.medium == "GPU"
    assert isinstance(cleared, VllmCleared)


def test_with_vllm_installed_its_own_classes_decode_hicache_batches():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    events = tree_events([([5, 6, 7, 8, 1, 2, 3, 4], "tenant")])
    payload = encode_payload(KVEventBatch(1.0, [*events, AllBlocksCleared()], 0))
    batch = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch).decode(payload)
    stored, cleared = batch.events
    assert isinstance(stored, kv_events.BlockStored) and stored.token_ids == [5, 6, 7, 8, 1, 2, 3, 4]
    assert stored.extra_keys == [("tenant",), None] and isinstance(cleared, kv_events.AllBlocksCleared)


def vllm_chain(tokens: list[int], salt: str = "", first_parent: int | None = None) -> VllmStored:
    """A vLLM server's event for `tokens` in whole pages: its hashes are its own (random here)."""
    hashes = [random.getrandbits(63) for _ in range(len(tokens) // PAGE)]
    extra = [(salt,)] + [None] * (len(hashes) - 1) if salt else None
    return VllmStored(hashes, first_parent, tokens, PAGE, None, "GPU", None, extra, group_idx=0, locality="LOCAL")


@pytest.mark.parametrize("shape", ["maps", "arrays"])
def test_a_vllm_servers_events_find_a_prompts_pages_by_content(shape):
    """The index names a vLLM server's pages by hicache's chain, from their token ids: a prompt's chain
    finds its leading pages on whichever tier the events put them, under its own salt only."""
    system, user = [1, 2, 3, 4] * 3, [7, 7, 7, 7]
    head, tail = vllm_chain(system), None
    tail = vllm_chain(user, first_parent=head.block_hashes[-1])
    salted = vllm_chain(system, salt="tenant")
    offloaded = VllmStored(head.block_hashes[:2], None, system[: 2 * PAGE], PAGE, None, "CPU", None)
    batches: list[Any] = [(head, tail, salted, offloaded), (VllmRemoved(tail.block_hashes, "GPU"),)]
    if shape == "arrays":  # older vLLM: no media, no salt; removed pages named by their hash alone
        old = [OldVllmStored(e.block_hashes, e.parent_block_hash, e.token_ids, PAGE, None) for e in (head, tail)]
        batches = [old, [OldVllmRemoved(tail.block_hashes)]]
        payloads = [msgspec.msgpack.encode(OldVllmBatch(float(i), list(b))) for i, b in enumerate(batches)]
    else:
        payloads = [msgspec.msgpack.encode(VllmBatch(float(i), list(b), 0)) for i, b in enumerate(batches)]
    index = BlockIndex()
    for payload in payloads[:1]:
        for event in decode_payload(payload).events:
            index.apply(event)
    prompt = prompt_hashes(system + user, PAGE)
    assert index.match(prompt)["device"] == 4
    assert index.prefix_tiers(prompt) == ["device"] * 4
    if shape == "maps":
        assert index.match(prompt)["host"] == 2
        assert index.match(prompt_hashes(system, PAGE, "tenant"))["device"] == 3
    for event in decode_payload(payloads[1]).events:
        index.apply(event)
    assert index.match(prompt)["device"] == 3  # the user's page dropped
    assert index.match(prompt_hashes(system, PAGE, "other"))["device"] == 0


def test_a_page_whose_parent_was_never_seen_or_sent_without_tokens_is_held_but_never_matched():
    orphan = vllm_chain([3, 3, 3, 3], first_parent=12345)
    tokenless = VllmStored([random.getrandbits(63)], None, [], PAGE, None, "GPU", None)
    index = BlockIndex()
    for event in decode_payload(msgspec.msgpack.encode(VllmBatch(0.0, [orphan, tokenless]))).events:
        index.apply(event)
    assert index.counts()["device"] == 2
    assert index.chain_hashes()["device"] == set() and index.match(prompt_hashes([3, 3, 3, 3], PAGE))["device"] == 0


def test_what_is_not_a_batch_is_a_value_error():
    for payload in (b"\x01", msgspec.msgpack.encode({"ts": 1.0}), msgspec.msgpack.encode([1.0, [{"type": "X"}]])):
        with pytest.raises(ValueError):
            decode_payload(payload)


pages = st.lists(st.integers(0, 2), min_size=1, max_size=4)  # a prompt: up to 4 pages from 3 page kinds


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(pages, st.sampled_from(["", "t"]), st.sampled_from(["GPU", "CPU", "STORAGE"]), st.booleans()),
        min_size=1,
        max_size=12,
    )
)
def test_the_state_a_publisher_replays_rebuilds_its_index(steps):
    """Any history of pages stored and removed per tier: a subscriber that knows nothing and applies the
    publisher's state holds the same pages, and matches every prompt as the publisher's index does (a
    page whose parent went from every tier keeps no chain: it cannot start a prompt's run)."""
    source = BlockIndex(keep_tokens=True)
    prompts = []
    for kinds, salt, medium, remove in steps:
        tokens = [t for kind in kinds for t in [kind + 1] * PAGE]
        prompts.append(prompt_hashes(tokens, PAGE, salt))
        stored = tree_events([(tokens, salt)])  # one chain, from the root: every page of it
        for event in stored:
            source.apply(
                BlockStored(
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    PAGE,
                    None,
                    medium,
                    None,
                    event.extra_keys,
                )
            )
        if remove:
            source.apply(BlockRemoved(stored[0].block_hashes[-1:], medium))
    rebuilt = BlockIndex()
    for event in decode_payload(encode_payload(KVEventBatch(0.0, source.state_events()))).events:
        rebuilt.apply(event)
    assert rebuilt.pages == source.pages
    assert [rebuilt.match(p) for p in prompts] == [source.match(p) for p in prompts]


def publish_prompts(tree: RadixTree, publisher: KVEventPublisher, first: int, count: int) -> None:
    """Cache `count` one-page prompts of their own, one batch each."""
    for i in range(first, first + count):
        tree.insert([i % 200] * PAGE, [i])
        publisher.publish()


def wait_for(subscriber: KVEventSubscriber, seq_after: int | None, batches: int) -> None:
    """Apply what arrives until `batches` batches after `seq_after` are in (the publisher's thread sends them)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        subscriber.poll(100)
        if subscriber.seq is not None and seq_after is not None and subscriber.seq >= seq_after + batches:
            return
    raise AssertionError("the batches never came")


def test_replay_answers_from_the_buffer_or_with_the_state(monkeypatch):
    monkeypatch.setattr(publisher_module, "BUFFER_STEPS", 5)
    endpoint = f"tcp://127.0.0.1:{free_ports(2)}"
    tree = RadixTree(PAGE, on_device_free=lambda pages: None)
    publisher = KVEventPublisher(endpoint, tree.events)
    late, lossy = KVEventSubscriber(endpoint), KVEventSubscriber(endpoint)
    try:
        time.sleep(0.3)  # the SUB sockets connect
        first = publisher.seq
        publish_prompts(tree, publisher, 0, 8)  # more than the buffer
        wait_for(lossy, first, 8)
        late.catch_up()  # from 0: further back than the buffer, so the state, as one batch
        assert late.seq == publisher.seq and late.index.pages == lossy.index.pages
        assert late.index.counts()["device"] == 8
        before = lossy.seq
        publish_prompts(tree, publisher, 8, 3)
        messages: list[list[bytes]] = []
        while len(messages) < 3:  # live copies of the first eight, which the start's replay covered, may come first
            messages += [m for m in lossy.receive(timeout_ms=1000) if int.from_bytes(m[1], "big") > before]
        lossy.handle(messages[2])  # the first two lost: a gap within the buffer, replayed from it
        assert lossy.replays == 2 and lossy.seq == before + 3 == publisher.seq  # the first, at the start
        assert lossy.index.counts()["device"] == 11
        for message in messages[:2]:
            lossy.handle(message)  # late copies of what the replay covered: skipped
        assert lossy.replays == 2 and lossy.index.counts()["device"] == 11
    finally:
        for closing in (late, lossy, publisher):
            closing.close()


def test_without_a_replay_socket_the_subscriber_follows_the_live_batches():
    """A vLLM server started without a replay_endpoint never answers a replay: the subscriber waits out
    its timeout once, then applies what the live batches say (here a bare PUB socket, vLLM's frames)."""
    endpoint = f"tcp://127.0.0.1:{free_ports(2)}"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(endpoint)
    subscriber = KVEventSubscriber(endpoint, replay_timeout_s=0.2)
    try:
        time.sleep(0.3)  # the SUB socket connects
        for seq, tokens in enumerate(([1, 1, 1, 1], [2, 2, 2, 2])):
            batch = VllmBatch(float(seq), [vllm_chain(tokens)], 0)
            pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
            subscriber.poll(2000)
        assert subscriber.seq == 1 and subscriber.index.counts()["device"] == 2
    finally:
        subscriber.close()
        context.destroy(linger=0)
