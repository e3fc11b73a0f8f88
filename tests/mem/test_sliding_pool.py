"""A hybrid model's sliding-window pages (hicache/mem/sliding_pool.py) behind the device pool: the sliding
layers' rows live in their own, smaller buffers, found through the page map; the other layers' rows are
where they always were; pages given back free both."""

from __future__ import annotations

import pytest
import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout

PAGE = 4


def hybrid_pool(sliding_pages: int = 3) -> DeviceKVPool:
    return DeviceKVPool(KVLayout.mha(1, 2), 3, 8, PAGE, torch.float32, torch.device("cpu"),
                        sliding_layers=frozenset({1}), sliding_pages=sliding_pages, sliding_window=6)  # fmt: skip


def test_sliding_rows_live_in_their_own_smaller_buffer_through_the_page_map():
    pool = hybrid_pool()
    assert [b.shape[0] for b in pool.buffers] == [8 * PAGE, 4 * PAGE, 8 * PAGE]  # 3 pages + the zero page
    pages = pool.allocator.alloc(2)
    pool.sliding.attach(pages)
    slots = pool.allocator.slots(pages)
    rows = torch.arange(len(slots) * 4, dtype=torch.float32).view(len(slots), 4)
    for layer in range(3):
        pool.write_rows(layer, pool.owned(slots), rows + layer)
        assert torch.equal(pool.read_rows(layer, slots), rows + layer)
    assert torch.equal(pool.buffers[0][slots], rows)  # a full layer: at the slots themselves
    assert pool.layer_pages(1, pages) == [0, 1] and pool.layer_pages(0, pages) == pages


def test_freed_window_kv_reads_the_zero_page_and_page_copies_refuse_it():
    pool = hybrid_pool()
    pages = pool.allocator.alloc(2)
    pool.sliding.attach(pages)
    slots = pool.allocator.slots(pages)
    pool.write_rows(1, pool.owned(slots), torch.ones(len(slots), 4))
    assert pool.sliding.release(pages[:1]) == 1 and pool.sliding.held(pages) == [False, True]
    assert torch.equal(pool.read_rows(1, slots), torch.cat([torch.zeros(PAGE, 4), torch.ones(PAGE, 4)]))
    with pytest.raises(RuntimeError, match="window KV was freed"):
        pool.layer_pages(1, pages)


def test_a_tombstone_adopts_the_window_kv_of_the_same_tokens_computed_again():
    pool = hybrid_pool()
    tree_page, again = pool.allocator.alloc(2)
    pool.sliding.attach([tree_page, again])
    pool.sliding.release([tree_page])
    pool.sliding.adopt([tree_page], [again])
    assert pool.sliding.held([tree_page, again]) == [True, False]
    assert pool.sliding.used_pages == 1


def test_freeing_pages_frees_their_sliding_pages_and_a_resident_count_follows_them():
    pool = hybrid_pool()
    row_bytes = 4 * 4 * PAGE  # a page of one layer
    pages = pool.allocator.alloc(3)
    pool.sliding.attach(pages)
    assert pool.resident_bytes() == 3 * 3 * row_bytes
    pool.sliding.release(pages[:2])
    assert pool.resident_bytes() == 3 * 2 * row_bytes + 1 * row_bytes
    pool.free(pages)
    assert pool.allocator.free_pages == pool.allocator.num_pages and pool.sliding.used_pages == 0
    with pytest.raises(RuntimeError, match="no room"):
        pool.sliding.attach(pool.allocator.alloc(4))  # 3 sliding pages
