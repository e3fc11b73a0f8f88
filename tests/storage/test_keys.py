"""Chained page hashes and the namespace: the properties content addressing relies on."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache.storage.keys import ROOT_HASH, Namespace, page_hashes, salt_seed

TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=200)
PAGE = st.sampled_from([1, 2, 3, 4, 16])


def reference_chain(tokens: list[int], page_size: int) -> list[bytes]:
    """The definition, written the slow obvious way."""
    out, prev = [], bytes(32)
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{page_size}I", *page)).digest()
        out.append(prev)
    return out


@given(TOKENS, PAGE)
def test_matches_definition_and_is_deterministic(tokens: list[int], page_size: int) -> None:
    hashes = page_hashes(tokens, page_size)
    assert hashes == reference_chain(tokens, page_size)
    assert hashes == page_hashes(list(tokens), page_size)
    assert len(hashes) == len(tokens) // page_size  # full pages only


@given(TOKENS, PAGE, st.data())
def test_changing_a_token_changes_its_page_and_every_later_one(tokens: list[int], page_size: int, data) -> None:
    n_pages = len(tokens) // page_size
    if n_pages == 0:
        return
    pos = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[pos] = data.draw(st.integers(0, 2**32 - 1).filter(lambda t: t != tokens[pos]))
    before, after = page_hashes(tokens, page_size), page_hashes(changed, page_size)
    page = pos // page_size
    assert before[:page] == after[:page]  # a change in the trailing partial page changes nothing
    for i in range(page, n_pages):
        assert before[i] != after[i]


@given(TOKENS, PAGE, st.data())
def test_prefix_of_tokens_gives_prefix_of_hashes(tokens: list[int], page_size: int, data) -> None:
    cut = data.draw(st.integers(0, len(tokens)))
    full = page_hashes(tokens, page_size)
    assert page_hashes(tokens[:cut], page_size) == full[: cut // page_size]


@given(TOKENS, PAGE, st.data())
def test_prior_continues_the_chain(tokens: list[int], page_size: int, data) -> None:
    full = page_hashes(tokens, page_size)
    split = data.draw(st.integers(0, len(full))) * page_size  # a page boundary, as at a radix node
    head = page_hashes(tokens[:split], page_size)
    prior = head[-1] if head else None
    assert head + page_hashes(tokens[split:], page_size, prior=prior) == full
    assert page_hashes(tokens[split:], page_size, prior=ROOT_HASH) == page_hashes(tokens[split:], page_size)


def test_input_types_agree() -> None:
    tokens = list(range(100, 164))
    expected = page_hashes(tokens, 16)
    for variant in (np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.uint16), torch.tensor(tokens)):
        assert page_hashes(variant, 16) == expected


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        page_hashes([-1, 2], 1)
    with pytest.raises(ValueError):
        page_hashes([2**32], 1)
    with pytest.raises(ValueError):
        page_hashes([1, 2], 1, prior=b"short")
    with pytest.raises(TypeError):
        page_hashes([1.5, 2.0], 1)
    assert page_hashes([], 16) == []


def test_namespace_digest_and_key() -> None:
    ns = Namespace(model="abc123", kv_dtype="bfloat16", page_size=16, layout="page_rows", rank="tp0of2")
    assert len(ns.digest) == 16 and int(ns.digest, 16) >= 0
    assert ns.digest == Namespace("abc123", "bfloat16", 16, "page_rows", "tp0of2", 1).digest
    h = page_hashes(range(16), 16)[0]
    assert ns.object_key(h) == f"{h.hex()}_{ns.digest}"
    # Every field is part of the identity.
    variants = [
        Namespace("abc124", "bfloat16", 16, "page_rows", "tp0of2"),
        Namespace("abc123", "float32", 16, "page_rows", "tp0of2"),
        Namespace("abc123", "bfloat16", 32, "page_rows", "tp0of2"),
        Namespace("abc123", "bfloat16", 16, "unified", "tp0of2"),
        Namespace("abc123", "bfloat16", 16, "page_rows", "tp1of2"),
        Namespace("abc123", "bfloat16", 16, "page_rows", "tp0of2", schema_version=2),
    ]
    assert len({ns.digest, *(v.digest for v in variants)}) == len(variants) + 1
    with pytest.raises(ValueError):
        ns.object_key(b"\x00" * 31)
    with pytest.raises(ValueError):
        Namespace("abc", "bfloat16", 0, "page_rows")


def test_a_part_has_keys_of_its_own_and_the_targets_keys_do_not_change() -> None:
    ns = Namespace("abc123", "bfloat16", 16, "page_rows", "tp0of2")
    draft = Namespace("abc123", "bfloat16", 16, "page_rows", "tp0of2", part="draft")
    h = page_hashes(range(16), 16)[0]
    # Without a part the digest is that of the fields before parts existed: old stores stay readable.
    canonical = (
        '{"kv_dtype":"bfloat16","layout":"page_rows","model":"abc123",'
        '"page_size":16,"rank":"tp0of2","schema_version":1}'
    )
    assert ns.digest == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    # A part's keys end in `_{part}`: they can never equal a target key (exactly one '_'), even for
    # equal digests; and its digest differs too, so a swapped object fails the header check.
    assert draft.object_key(h) == f"{h.hex()}_{draft.digest}_draft" and draft.digest != ns.digest
    assert ns.object_key(h).count("_") == 1
    with pytest.raises(ValueError):
        Namespace("abc123", "bfloat16", 16, "page_rows", part="no_underscores")


# Digests computed by the per-page loop before the hashing was batched: stored pages are named by them,
# so any change of these values orphans every store (bump Namespace.schema_version instead, on purpose).
_PINNED_TOKENS = [(i * 2654435761) % 2**32 for i in range(64)]


def test_hashes_are_pinned() -> None:
    hashes = page_hashes(_PINNED_TOKENS, 16)
    assert [h.hex() for h in hashes[::3]] == [
        "333deb8588e6d96f0b7142208ca4696690743974cece136c6df32b9fbf5d844a",
        "1d9906d025069e5d21a845583fea9e458fa08db879a0540f430f57a10e83d1a7",
    ]
    assert page_hashes(range(5), 1)[-1].hex() == "4647e2de5a608210b4dc98b66f96c88055005c48c4dc978dec033939f72c90bf"
    prior = bytes(range(32))
    assert page_hashes(_PINNED_TOKENS, 16, prior)[-1].hex() == (
        "ac3bc0ba7dad367a0a9d01920781a296bf296841ea7da8096b5a86461463f57c"
    )


@given(TOKENS, PAGE, st.text(min_size=1, max_size=20), st.text(max_size=20))
def test_a_cache_salt_gives_every_page_its_own_key(tokens, page_size, salt, other):
    """Unsalted keys are what they always were; a salted chain shares no key with the unsalted one or
    with another salt's (framed and domain-separated, so no salt's seed is another's)."""
    assert page_hashes(tokens, page_size, salt_seed("")) == reference_chain(tokens, page_size)
    salted = page_hashes(tokens, page_size, salt_seed(salt))
    assert not set(salted) & set(reference_chain(tokens, page_size))
    if other != salt:
        assert not set(salted) & set(page_hashes(tokens, page_size, salt_seed(other)))
    assert salted == page_hashes(tokens, page_size, salt_seed(salt))  # every server computes the same
