"""The object envelope: round trips, zero-copy decode, and detection of every kind of damage."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache.storage.codec import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    CorruptObject,
    decode,
    encode,
    encode_parts,
    verify_parts,
)

KEY = hashlib.sha256(b"page").digest()
OTHER_KEY = hashlib.sha256(b"other page").digest()
NS = "0123456789abcdef"
OTHER_NS = "fedcba9876543210"


@given(st.binary(max_size=4096))
def test_round_trip(payload: bytes) -> None:
    blob = encode(KEY, NS, payload)
    assert len(blob) == HEADER_SIZE + len(payload)
    assert bytes(decode(blob, KEY, NS)) == payload


@given(st.binary(max_size=4096))
def test_parts_form(payload: bytes) -> None:
    header, view = encode_parts(KEY, NS, payload)
    assert len(header) == HEADER_SIZE and view.obj is payload  # the payload is not copied
    blob = encode(KEY, NS, payload)
    assert header + bytes(view) == blob
    verify_parts(header, bytearray(payload), len(blob), KEY, NS)  # as read back into a destination
    with pytest.raises(CorruptObject):
        verify_parts(header, bytearray(payload) + b"x", len(blob), KEY, NS)  # destination of another size
    with pytest.raises(CorruptObject):
        verify_parts(header, bytearray(payload), len(blob) + 1, KEY, NS)  # object larger than its header says
    with pytest.raises(CorruptObject):
        verify_parts(header[:10] + bytes(HEADER_SIZE - 10), bytearray(payload), 10, KEY, NS)  # truncated


@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_flipped_byte_is_detected_in_parts_form(payload: bytes, data) -> None:
    blob = bytearray(encode(KEY, NS, payload))
    blob[data.draw(st.integers(0, len(blob) - 1))] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptObject):
        verify_parts(blob[:HEADER_SIZE], blob[HEADER_SIZE:], len(blob), KEY, NS)


def test_decode_is_zero_copy() -> None:
    blob = bytearray(encode(KEY, NS, b"x" * 1000))
    view = decode(blob, KEY, NS)
    assert view.obj is blob  # a slice of the fetched object, not a copy


def test_tensor_payloads() -> None:
    # How a KV page gets in: a contiguous tensor viewed as bytes (bf16 has no numpy dtype, so via uint8).
    page = torch.randn(16, 30 * 2 * 3 * 64).to(torch.bfloat16)
    view = memoryview(page.view(torch.uint8).numpy())
    payload = decode(encode(KEY, NS, view), KEY, NS)
    restored = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).view(page.shape)
    assert torch.equal(restored, page)
    # Multi-dimensional and non-byte buffers are taken as their flat bytes.
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert bytes(decode(encode(KEY, NS, memoryview(arr)), KEY, NS)) == arr.tobytes()


def test_each_failure_names_its_reason() -> None:
    blob = encode(KEY, NS, b"payload bytes")
    cases = {
        "truncated": blob[: HEADER_SIZE - 1],
        "bad magic": b"X" + blob[1:],
        "format version": blob[:8] + struct.pack("<I", FORMAT_VERSION + 1) + blob[12:],
        "namespace": encode(KEY, OTHER_NS, b"payload bytes"),
        "wrong key": encode(OTHER_KEY, NS, b"payload bytes"),
        "header says": blob[:-1],  # payload shorter than the header's length
        "checksum": blob[:-1] + bytes([blob[-1] ^ 1]),
    }
    for reason, bad in cases.items():
        with pytest.raises(CorruptObject) as info:
            decode(bad, KEY, NS)
        assert reason in info.value.reason, (reason, info.value.reason)
    assert bytes(decode(blob, KEY, NS)) == b"payload bytes"
    assert blob.startswith(MAGIC)


@given(st.binary(min_size=0, max_size=512), st.data())
def test_any_flipped_byte_is_detected(payload: bytes, data) -> None:
    blob = bytearray(encode(KEY, NS, payload))
    pos = data.draw(st.integers(0, len(blob) - 1), label="position")
    mask = data.draw(st.integers(1, 255), label="xor mask")
    blob[pos] ^= mask
    with pytest.raises(CorruptObject):
        decode(blob, KEY, NS)


def test_every_position_and_bit_of_a_small_object() -> None:
    # Exhaustive over one object: every byte of header and payload, every single-bit flip.
    blob = encode(KEY, NS, bytes(range(256)))
    for pos in range(len(blob)):
        for bit in range(8):
            bad = bytearray(blob)
            bad[pos] ^= 1 << bit
            with pytest.raises(CorruptObject):
                decode(bad, KEY, NS)


@given(st.binary(max_size=512), st.data())
def test_any_truncation_or_extension_is_detected(payload: bytes, data) -> None:
    blob = encode(KEY, NS, payload)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CorruptObject):
        decode(blob[:cut], KEY, NS)
    with pytest.raises(CorruptObject):
        decode(blob + data.draw(st.binary(min_size=1, max_size=8)), KEY, NS)


def test_caller_bugs_are_value_errors() -> None:
    with pytest.raises(ValueError):
        encode(KEY[:16], NS, b"")
    with pytest.raises(ValueError):
        encode(KEY, "abc", b"")
