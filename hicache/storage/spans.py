"""The envelope of a unified-layout object (unified.py), verifiable one span at a time.

A reader of another topology may need only some layers of an object, fetched by a ranged read, so one
checksum over the whole payload (codec.py) cannot verify it. Instead the header is followed by a
table with one CRC-32 per layer of the object's data; a reader fetches the header and table (a small
ranged read) and its span, and checks exactly the layers it got.

    header   64 bytes, codec's struct: magic b"HICUNIF\\x00", FORMAT_VERSION, CRC-32 of the table,
             namespace digest, SHA-256 of the object's key (so an object stored under another cell's
             or page's key fails), data length
    table    u32 little-endian CRC-32 per layer of the object, in layer order
    data     the layers back to back, layer_bytes each

Every check failing raises codec.CorruptObject, which the store counts as a miss.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from hicache.storage.codec import _HEADER, FORMAT_VERSION, HEADER_SIZE, BytesLike, CorruptObject, _namespace_bytes

MAGIC = b"HICUNIF\x00"


def prefix_size(num_layers: int) -> int:
    """Bytes before the data: header and checksum table."""
    return HEADER_SIZE + 4 * num_layers


def encode_prefix(key: str, namespace_digest: str, data: BytesLike, layer_bytes: int) -> bytes:
    """Header and checksum table of an object holding `data` (whole layers of layer_bytes each)."""
    view = memoryview(data).cast("B")
    if layer_bytes <= 0 or view.nbytes % layer_bytes:
        raise ValueError(f"{view.nbytes} bytes of data are not whole layers of {layer_bytes}")
    crcs = [zlib.crc32(view[i : i + layer_bytes]) for i in range(0, view.nbytes, layer_bytes)]
    table = struct.pack(f"<{len(crcs)}I", *crcs)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, zlib.crc32(table), _namespace_bytes(namespace_digest), _key_hash(key), view.nbytes
    )
    return header + table


def verify_span(
    key: str,
    namespace_digest: str,
    prefix: BytesLike,
    num_layers: int,
    layer_bytes: int,
    first_layer: int,
    span: BytesLike,
) -> None:
    """Check `span`, layers first_layer.. of the object stored under `key` (object-local layer index),
    against the object's `prefix` (header + table as read). The object must hold `num_layers` layers."""
    prefix = memoryview(prefix).cast("B")
    span = memoryview(span).cast("B")
    if prefix.nbytes != prefix_size(num_layers):
        raise CorruptObject(f"truncated: {prefix.nbytes} header bytes, expected {prefix_size(num_layers)}")
    magic, version, table_crc, namespace, key_hash, length = _HEADER.unpack(prefix[:HEADER_SIZE])
    table = prefix[HEADER_SIZE:]
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptObject(f"format version {version}, expected {FORMAT_VERSION}")
    if namespace != _namespace_bytes(namespace_digest):
        raise CorruptObject(f"namespace {namespace.hex()}, expected {namespace_digest}")
    if key_hash != _key_hash(key):
        raise CorruptObject("stored under the wrong key")
    if length != num_layers * layer_bytes:
        raise CorruptObject(f"data is {length} bytes, expected {num_layers} layers of {layer_bytes}")
    if zlib.crc32(table) != table_crc:
        raise CorruptObject("checksum table mismatch")
    if span.nbytes % layer_bytes or first_layer + span.nbytes // layer_bytes > num_layers:
        raise CorruptObject(f"span of {span.nbytes} bytes from layer {first_layer} is not inside the object")
    crcs = struct.unpack(f"<{num_layers}I", table)
    for i in range(span.nbytes // layer_bytes):
        if zlib.crc32(span[i * layer_bytes : (i + 1) * layer_bytes]) != crcs[first_layer + i]:
            raise CorruptObject(f"checksum mismatch in layer {first_layer + i} of the object")


def _key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
