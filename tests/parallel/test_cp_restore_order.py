"""Restore local pages -> gather the prefix -> attention, ordered by events (hicache/model/attention/kv_gather.py):
two CP ranks back a prefix up to their own host pools, lose it from the device, and load it back
with every layer's copy landing late (--debug-transfer-delay-ms, another rhythm on each rank); the
per-layer gathered buffer, which is exactly what attention reads, holds the expected KV of every
page on every layer. The negative control gathers without waiting for the restore events and reads
pages not restored yet, so the check would fail if the order broke."""

import logging

import pytest
import torch

from hicache.cache.device_tier import DeviceTier
from hicache.cache.host_tier import HostTier, WritePolicy
from hicache.config import EngineConfig, ParallelConfig
from hicache.engine.rank_worker import RankSpec, init_distributed
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_pool import HostKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.model.attention.kv_gather import GatherPlan, GatherStats, PrefixGather, ScratchBuffers
from hicache.parallel.consensus import Consensus
from tests.parallel.ranks import outcomes_of, report

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PAGE, LAYERS, PAGES = 4, 4, 6
LAYOUT = KVLayout.mha(1, 8)
DELAY_S = 0.4  # a whole load lands up to this late, spread over its layers


def expected(slots: torch.Tensor, layer: int) -> torch.Tensor:
    """The KV a fake model wrote for logical slot x at `layer`: a value only (x, layer) has."""
    return (slots.float() * 10 + layer + 1).unsqueeze(1).repeat(1, LAYOUT.row_numel)


def restore_and_gather(pool, device, host, tokens, pctx, ordered: bool) -> list[int]:
    """Lose the prefix from the device, load it back, gather every layer; the layers whose gathered
    pages differ from the expected KV."""
    device.tree.evict(PAGES)  # backed up: stays as host-only nodes
    for buffer in pool.buffers:
        buffer.zero_()  # a page read before its restore is zeros, never the right values
    match = device.tree.match_prefix(tokens)
    assert len(match.host_pages) == PAGES and not match.device_pages
    device.tree.lock(match.last_node)
    pages = host.load_back(match, PAGES, lambda n, classes: device.alloc(n, classes=classes)).device_pages
    restored = host.before_layer() if ordered else None
    plan = GatherPlan.build([torch.tensor(pages)], 2, pctx.cp_rank, torch.device("cpu"))
    scratch = ScratchBuffers(2 * pool.local_pages * PAGE, LAYOUT.row_numel, torch.float32, torch.device("cpu"))
    gather = PrefixGather(plan, pool, scratch, pctx.side_group("cp"), restored, GatherStats())
    slots = pool.allocator.slots(pages)
    wrong = []
    for layer in range(LAYERS):
        got = gather.wait(layer).index_select(0, plan.rows(slots, PAGE))
        if not torch.equal(got, expected(slots, layer)):
            wrong.append(layer)
        gather.release(layer)
    host.drain()
    device.tree.unlock(match.last_node)
    return wrong


def rank_main(rank: int, init: str, results) -> None:
    cfg = EngineConfig(parallel=ParallelConfig(cp_size=2))
    pctx = init_distributed(RankSpec(rank, rank, 2, init, 1, logging.WARNING), cfg)
    pool = DeviceKVPool(LAYOUT, LAYERS, 8, PAGE, torch.float32, torch.device("cpu"), shards=2, shard_rank=pctx.cp_rank)
    host_pool = HostKVPool(pool, 16)
    device = DeviceTier(pool, on_host_free=host_pool.allocator.free)
    host = HostTier(pool, host_pool, device.tree, device.budget, Consensus(pctx), WritePolicy.WRITE_THROUGH, 0, DELAY_S)
    tokens = list(range(100, 100 + PAGES * PAGE))
    pages = device.alloc(PAGES, classes=device.budget.classes(0, 0, PAGES))
    slots = pool.allocator.slots(pages)
    for layer in range(LAYERS):
        pool.write_rows(layer, pool.owned(slots), expected(slots, layer))  # this rank's pages only
    node = device.insert(tokens, pages, "", rotation=0).last_node
    host.backup(node)
    host.drain()
    held = host_pool.resident_bytes()
    outcome = {
        "ordered": restore_and_gather(pool, device, host, tokens, pctx, ordered=True),
        "unordered": restore_and_gather(pool, device, host, tokens, pctx, ordered=False),
        "host_pages_here": held // host_pool.page_bytes,
    }
    host.shutdown()
    report(rank, outcome, pctx, results)


def test_attention_never_reads_a_page_before_its_restore_finished():
    outcomes = outcomes_of(rank_main, 2)
    for rank, outcome in outcomes.items():
        assert outcome["host_pages_here"] == PAGES // 2, outcome  # each rank backed up its own half
        assert outcome["ordered"] == [], f"rank {rank} gathered unrestored pages at layers {outcome['ordered']}"
    assert any(o["unordered"] for o in outcomes.values()), "the negative control should read pages too early"
