"""A page table's slots are its pages' slots, whatever it went through: pages appended a few at a time
(past its room, so it grows), a prefix replaced by other pages, cleared; and a view taken before it grew
still reads the slots it read."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.mem.page_table import PageTable, page_slots

PAGE = 4
page_ids = st.lists(st.integers(0, 10_000), max_size=5)
operations = st.lists(st.tuples(st.sampled_from(("append", "replace", "clear")), page_ids), max_size=30)


@settings(max_examples=100, deadline=None)
@given(operations=operations)
def test_any_sequence_of_changes_keeps_the_slots_of_the_pages(operations):
    table, pages = PageTable(PAGE), []
    for operation, ids in operations:
        before = table.slots()
        kept = before.clone()
        if operation == "append":
            table.append(ids)
            pages += ids
        elif operation == "replace":
            ids = ids[: len(pages)]
            table.replace(ids)
            pages[: len(ids)] = ids
        else:
            table.clear()
            pages = []
        assert table.pages == pages
        assert torch.equal(table.slots(), page_slots(pages, PAGE))
        for end in (0, len(pages) * PAGE // 2, len(pages) * PAGE):
            assert torch.equal(table.slots(end), page_slots(pages, PAGE)[:end])
        if operation == "append":
            assert torch.equal(before, kept), "growing the table changed a view taken before"


def test_slots_past_the_pages_and_a_replace_longer_than_the_table_are_refused():
    table = PageTable(PAGE)
    table.append([7, 3])
    with pytest.raises(ValueError, match="hold 8"):
        table.slots(9)
    with pytest.raises(ValueError, match="3 pages replace a table of 2"):
        table.replace([1, 2, 3])
