"""Property tests of the packed radix keys (hicache/cache/page_keys.py): packing any token container
gives the same bytes, the memcmp bisection finds the same common pages as a page-by-page comparison,
and the tree's matches equal a naive page-by-page reference on random trees, whatever container the
tokens come in and whatever the page size."""

from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.page_keys import PackedTokens, common_pages, key_digest, pack, unpack
from hicache.cache.radix import RadixTree

tokens = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)
small = st.lists(st.integers(0, 2), max_size=24)  # shared prefixes (and splits) are common

CONTAINERS = {
    "list": list,
    "tuple": tuple,
    "array_q": lambda t: array("q", t),
    "array_i": lambda t: array("i", t),
    "numpy64": lambda t: np.asarray(t, dtype=np.int64),
    "numpy32": lambda t: np.asarray(t, dtype=np.int32),
    "numpy_strided": lambda t: np.repeat(np.asarray(t, dtype=np.int64), 2)[::2],
    "torch": lambda t: torch.tensor(t, dtype=torch.int64),
    "packed": PackedTokens,
    "memoryview": lambda t: memoryview(array("q", t)),
}


@given(tokens, st.sampled_from(sorted(CONTAINERS)))
def test_pack_is_the_same_bytes_for_every_container(ids, kind):
    if kind in ("array_i", "numpy32"):
        ids = [t % 2**31 for t in ids]
    packed = pack(CONTAINERS[kind](ids))
    assert bytes(packed) == array("q", ids).tobytes()
    assert list(unpack(packed)) == ids
    assert key_digest(bytes(packed)) == key_digest(packed)


def test_out_of_int64_is_an_error():
    for ids in ([2**63], [-(2**63) - 1], np.array([2**63], dtype=np.uint64), array("Q", [2**63])):
        with pytest.raises(OverflowError):
            pack(ids)


@given(small, small, st.integers(1, 5), st.integers(0, 6))
def test_common_pages_equals_page_by_page(key, query, page, skip):
    key = key[: len(key) - len(key) % page]
    pos = min(skip, len(query) // page) * page
    expected = 0
    while (expected + 1) * page <= min(len(key), len(query) - pos) and key[
        expected * page : (expected + 1) * page
    ] == query[pos + expected * page : pos + (expected + 1) * page]:
        expected += 1
    got = common_pages(bytes(pack(key)), pack(query), pos * 8, page * 8)
    assert got == expected


@given(small, small)
def test_common_prefix_of_packed_prompts(a, b):
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert PackedTokens(a).common_prefix(PackedTokens(b)) == expected


@given(small, small, st.integers(0, 50), st.sampled_from(sorted(set(CONTAINERS) - {"packed"})))
def test_prefix_of_a_sequence_packs_only_its_rest(prompt, output, n, kind):
    sequence = prompt + output  # a request's: its prompt, then its output
    n = min(n, len(sequence))
    packed = PackedTokens(CONTAINERS[kind](prompt)).prefix_of(CONTAINERS[kind](sequence), n)
    assert bytes(packed) == bytes(pack(sequence[:n]))


def naive_match(inserted: set, ids: list[int], ns: str, page: int) -> int:
    n = 0
    while n + page <= len(ids) and (ns, tuple(ids[: n + page])) in inserted:
        n += page
    return n


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(
        st.tuples(st.booleans(), small, st.sampled_from(["", "salt"]), st.sampled_from(sorted(CONTAINERS))), max_size=30
    ),
)
def test_match_equals_naive_reference_on_random_trees(page, operations):
    tree = RadixTree(page, on_device_free=lambda pages: None)
    inserted: set = set()
    next_page = 0
    for is_insert, ids, ns, kind in operations:
        ids = ids[: len(ids) - len(ids) % page] if is_insert else ids
        container = CONTAINERS[kind](ids)
        if is_insert:
            pages = list(range(next_page, next_page + len(ids) // page))
            next_page += len(pages)
            res = tree.insert(container, pages, ns)
            assert len(res.pages) == len(pages)
            inserted.update((ns, tuple(ids[:i])) for i in range(page, len(ids) + 1, page))
        m = tree.match_prefix(container, ns)
        assert m.num_tokens == naive_match(inserted, ids, ns, page)
        # the matched nodes cover exactly the matched tokens, in order
        covered = [t for node in tree.path_to_root(m.last_node) for t in node.tokens]
        assert covered == ids[: m.num_tokens]
    for node in tree.nodes():
        assert node.num_tokens % page == 0 and node.num_tokens > 0
        assert len(node.device_pages) * page == node.num_tokens
        for key, child in node.children.items():
            assert key == child.key[: page * 8] and child.parent is node
