"""The self-checking envelope every stored object is wrapped in: a 64-byte header, then the payload.

The storage tier never trusts a backend: a page may be torn by a crash, truncated by a full disk,
written by another model, or stored under the wrong key by a bug. `decode` proves the object is the one
asked for, whole, before a byte of it reaches a KV pool; any doubt raises CorruptObject, which callers
treat as a miss (docs/DESIGN.md, "A cache never changes an answer").

Header (little-endian, 64 bytes, so the payload starts 64-byte aligned within the blob):
    magic         8s   b"HICACHE\\x00"
    version       u32  FORMAT_VERSION (the envelope's format, not the payload's schema)
    checksum      u32  CRC-32 of the payload
    namespace     8s   the namespace digest (Namespace.digest, 16 hex chars) as raw bytes
    key hash      32s  the page hash the object is stored under
    payload len   u64

Every header byte is compared against an expected value and every payload byte is covered by the CRC,
and CRC-32 detects every error burst of up to 32 bits, so any single flipped byte anywhere is detected.

Checksum choice: zlib.crc32 runs at ~4.2 GB/s on 1 MiB payloads on the reference machine against ~0.9
GB/s for blake2b(digest_size=16) (xxhash is not a dependency). The checksum guards against accidents
(torn writes, truncation, bit rot), not adversaries: the key hash and namespace are checked exactly.
"""

from __future__ import annotations

import struct
import zlib

from hicache.storage.keys import HASH_BYTES, NAMESPACE_DIGEST_HEX

# Any contiguous buffer: bytes, bytearray, or a memoryview over numpy / torch (uint8-viewed) memory.
BytesLike = bytes | bytearray | memoryview

MAGIC = b"HICACHE\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sII8s32sQ")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 64


class CorruptObject(Exception):
    """A stored object that is not the intact page it claims to be; `reason` says which check failed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode_parts(key_hash: bytes, namespace_digest: str, payload: BytesLike) -> tuple[bytes, memoryview]:
    """The object as (header, payload view), without copying the payload: for backends that can write
    scattered buffers (the file backend writes the two parts back to back)."""
    view = _byte_view(payload)
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        zlib.crc32(view),
        _namespace_bytes(namespace_digest),
        _check_hash(key_hash),
        view.nbytes,
    )
    return header, view


def encode(key_hash: bytes, namespace_digest: str, payload: BytesLike) -> bytes:
    """Header + payload as one bytes object (one copy of the payload)."""
    return b"".join(encode_parts(key_hash, namespace_digest, payload))


def decode(blob: BytesLike, expected_key_hash: bytes, expected_namespace_digest: str) -> memoryview:
    """The payload of `blob` as a zero-copy view, after checking every header field and the checksum."""
    view = _byte_view(blob)
    if view.nbytes < HEADER_SIZE:
        raise CorruptObject(f"truncated: {view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    payload = view[HEADER_SIZE:]
    _verify(view[:HEADER_SIZE], payload, payload.nbytes, expected_key_hash, expected_namespace_digest)
    return payload


def verify_parts(
    header: BytesLike,
    payload: BytesLike,
    object_size: int,
    expected_key_hash: bytes,
    expected_namespace_digest: str,
) -> None:
    """Check an object that was read in two parts (a scatter read straight into its destination):
    `header` holds its first HEADER_SIZE bytes, `payload` the caller's buffer for the rest, and
    `object_size` is the stored object's full size. The object must fill the buffer exactly."""
    if object_size < HEADER_SIZE:
        raise CorruptObject(f"truncated: {object_size} bytes is shorter than the {HEADER_SIZE}-byte header")
    view = _byte_view(payload)
    if object_size - HEADER_SIZE != view.nbytes:
        raise CorruptObject(f"payload is {object_size - HEADER_SIZE} bytes, the destination holds {view.nbytes}")
    _verify(_byte_view(header), view, object_size - HEADER_SIZE, expected_key_hash, expected_namespace_digest)


def _verify(header: memoryview, payload: memoryview, stored_payload_size: int, key: bytes, namespace: str) -> None:
    magic, version, checksum, namespace_bytes, key_hash, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptObject(f"format version {version}, expected {FORMAT_VERSION}")
    if namespace_bytes != _namespace_bytes(namespace):
        raise CorruptObject(f"namespace {namespace_bytes.hex()}, expected {namespace}")
    if key_hash != _check_hash(key):
        raise CorruptObject(f"stored under the wrong key: header says {key_hash.hex()}")
    if stored_payload_size != length:
        raise CorruptObject(f"payload is {stored_payload_size} bytes, header says {length}")
    if zlib.crc32(payload) != checksum:
        raise CorruptObject("checksum mismatch")


def _byte_view(buf: BytesLike) -> memoryview:
    # Accept any contiguous buffer (bytes, bytearray, numpy/torch-backed views) as flat bytes without copying.
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _namespace_bytes(digest: str) -> bytes:
    if len(digest) != NAMESPACE_DIGEST_HEX:
        raise ValueError(f"namespace digest must be {NAMESPACE_DIGEST_HEX} hex chars, got {digest!r}")
    return bytes.fromhex(digest)


def _check_hash(key_hash: bytes) -> bytes:
    if len(key_hash) != HASH_BYTES:
        raise ValueError(f"key hash must be {HASH_BYTES} bytes, got {len(key_hash)}")
    return bytes(key_hash)
