"""Content addresses for the storage tier: chained page hashes and the namespace digest.

A page's identity is its whole prefix, not just its own tokens: digest_i = SHA-256(digest_{i-1} || tokens
of page i as 4-byte little-endian ints), with digest_{-1} = 32 zero bytes. Two servers that saw the same
prefix compute the same keys without talking to each other, so the store is stateless and shareable and
the radix tree never tracks what storage holds (docs/DESIGN.md, "Content-addressed pages").

The namespace digest covers everything that makes the bytes of a page mean something (model, KV dtype,
page size, layout, rank shard, schema version). It is part of every object key and every object header,
so pages written by another model or layout are a miss, never wrong bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

HASH_BYTES = 32  # SHA-256
ROOT_HASH = bytes(HASH_BYTES)  # digest_{-1}: the chain's seed, the "parent" of the first page
SALT_DOMAIN = b"hicache/cache_salt/v1\0"  # keeps a salted seed from equalling any page digest
NAMESPACE_DIGEST_HEX = 16  # 64 bits: collisions between namespaces a deployment actually uses are negligible


def page_hashes(tokens: Sequence[int] | np.ndarray, page_size: int, prior: bytes | None = None) -> list[bytes]:
    """Chained SHA-256 digests of the full pages of `tokens` (a trailing partial page gets none).

    `prior` is the digest of the page just before `tokens[0]` (e.g. a radix node's parent page), so a
    caller can continue a chain without rehashing the prefix; None starts a new chain at ROOT_HASH.
    Token ids must fit in 32 unsigned bits: they are hashed as '<u4', so the digests do not depend on
    the platform or on the integer type the caller happens to hold (list, numpy, CPU torch tensor).
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    prev = ROOT_HASH if prior is None else bytes(prior)
    if len(prev) != HASH_BYTES:
        raise ValueError(f"prior must be a {HASH_BYTES}-byte digest, got {len(prev)} bytes")
    packed = pack_u32(tokens)
    full = packed.size - packed.size % page_size
    # Every page's bytes cut out by numpy in one pass (a row of page_size '<u4' read as one opaque
    # item), so the loop left is one SHA-256 per page: the chain makes each depend on the one before
    # (docs/BENCHMARKS.md, "Prompt-length paths", measures it against SHA-256 over the same bytes).
    pages = packed[:full].view(np.dtype((np.void, 4 * page_size))).tolist()
    out: list[bytes] = []
    sha256 = hashlib.sha256
    for page in pages:
        h = sha256(prev)
        h.update(page)
        prev = h.digest()
        out.append(prev)
    return out


def salt_seed(cache_salt: str) -> bytes:
    """The digest a request's chain starts from (`prior` of its first page): ROOT_HASH without a salt, so
    unsalted keys stay as they were; else SHA-256 over a domain tag, the salt's length and its UTF-8
    bytes (framed, so no salt's seed equals another's or an unsalted page's digest). Tenants with
    different salts never share a page hash on any tier, nor in the KV events (hicache/events/)."""
    if not cache_salt:
        return ROOT_HASH
    salt = cache_salt.encode()
    return hashlib.sha256(SALT_DOMAIN + len(salt).to_bytes(8, "little") + salt).digest()


def pack_u32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """`tokens` as a contiguous '<u4' array, the byte form content addresses and digests hash (checked:
    ids outside 32 unsigned bits are an error, not a wrap), at C speed whatever the container."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        # An empty Python list comes back as float64, handled above; anything else non-integer is a bug.
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


@dataclass(frozen=True)
class Namespace:
    """Everything that makes a stored page's bytes interpretable. Change any field and every key changes.

    model: a digest (or other stable id) of the model identity: architecture, weights, tokenizer.
    kv_dtype: the logical KV dtype name, e.g. "bfloat16".
    page_size: tokens per page; the chain's page boundaries depend on it.
    layout: the object layout name (e.g. "page_rows", "unified"), including any grid it implies.
    rank: the shard this rank stores, e.g. "tp0of2" ("" when a page is stored whole); ranks holding
        different slices of a page must never read each other's objects.
    schema_version: bumped whenever the meaning of a payload changes without the fields above changing.
    part: which of a page's objects this is: "" for the model's own KV, "draft" for a speculative
        draft's state stored beside it. A non-empty part ends every key with `_{part}`, so a part's
        keys can never equal the target's (whose keys have exactly one `_`), whatever the digests.
    """

    model: str
    kv_dtype: str
    page_size: int
    layout: str
    rank: str = ""
    schema_version: int = 1
    part: str = ""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if not self.model or not self.kv_dtype or not self.layout:
            raise ValueError("model, kv_dtype and layout must be non-empty")
        if self.part and not self.part.isalnum():
            raise ValueError(f"part must be alphanumeric, got {self.part!r}")

    @cached_property
    def digest(self) -> str:
        """16 hex chars of SHA-256 over the canonical JSON of the fields (sorted keys, no whitespace)."""
        fields = asdict(self)
        if not self.part:
            del fields["part"]  # the target's digest is what it was before parts existed: stores stay readable
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:NAMESPACE_DIGEST_HEX]

    def object_key(self, page_hash: bytes) -> str:
        """The storage key of one page: f"{page_hash.hex()}_{digest}", then f"_{part}" for a part. Keys
        lead with the page hash so a file store's fan-out by the first characters spreads evenly."""
        if len(page_hash) != HASH_BYTES:
            raise ValueError(f"page hash must be {HASH_BYTES} bytes, got {len(page_hash)}")
        return f"{page_hash.hex()}_{self.digest}" + (f"_{self.part}" if self.part else "")
