import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.mem.allocator import PageAllocator


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60))
def test_alloc_free_conserves_pages(ops):
    a = PageAllocator(16, 4)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            pages = a.alloc(n)
            if pages is None:
                assert n > a.free_pages
            else:
                held.append(pages)
        elif held:
            a.free(held.pop(n % len(held)))
        owned = [p for h in held for p in h]
        assert len(owned) == len(set(owned)), "a page was handed out twice"
        assert a.free_pages + len(owned) == 16


def test_lowest_pages_first_and_slots():
    a = PageAllocator(8, 4)
    assert a.alloc(2) == [0, 1]
    assert a.slots([3, 0], 6).tolist() == [12, 13, 14, 15, 0, 1]


def test_double_free_is_detected():
    a = PageAllocator(2, 4)
    pages = a.alloc(2)
    a.free(pages)
    with pytest.raises(RuntimeError):
        a.free(pages)
