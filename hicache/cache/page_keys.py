"""Radix-tree keys as packed bytes (docs/DESIGN.md, "radix tree": keys compared at C speed).

A key is a run of token ids stored as native-endian int64s in one `bytes` object, so comparing two runs
is one `memcmp` and finding where they diverge is a bisection over pages of `memcmp`s, not a Python loop
over tokens or pages. At 1M tokens a full match is ~8 MB of memcmp (well under a millisecond) instead of
~15,600 tuple comparisons.

A query (what `match_prefix` and `insert` get) is packed once into a flat byte view: zero-copy when the
caller already holds int64s in a buffer (array('q'), a C-contiguous int64 numpy array, a `PackedTokens`
of a request's prompt), one C-speed conversion otherwise (a list of ints: `np.fromiter`, the fastest
of the conversions measured in docs/BENCHMARKS.md section 8). int64 rather than int32
because the arrays callers hold are int64 (SGLang's and the benchmark's `array('q')`, numpy's default),
so their buffers are used as they are; token ids outside int64 are an error, not a silent wrap.

The keys live only in this process (they are never hashed for storage or sent to another rank: storage
hashes use hicache/storage/keys.py on the unpacked ids), so native byte order is fine. NOTE: Python's
hash() of bytes is salted per process (PYTHONHASHSEED), unlike the hash of a tuple of ints, so an
identity that ranks compare must use `key_digest`, never hash(key).
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Sequence

import numpy as np

TOKEN_BYTES = 8  # int64
_INT64_FORMATS = frozenset({"q", "l", "<q", "<l", "=q", "=l", "@q", "@l"})
_INT64_MAX = np.iinfo(np.int64).max

Packed = bytes | memoryview  # a flat byte view ('B') of int64 token ids


class PackedTokens:
    """A token sequence packed once, for a caller that matches the same prompt again and again (a
    waiting request re-tried by admission each step): `view(n)` is its first n tokens, zero-copy."""

    __slots__ = ("_bytes", "_tokens", "_view")

    def __init__(self, tokens: Tokens) -> None:
        self._bytes = bytes(pack(tokens))  # owned: the caller's buffer may change later
        self._view = memoryview(self._bytes)
        self._tokens = len(self._bytes) // TOKEN_BYTES

    def __len__(self) -> int:
        return self._tokens

    def view(self, n: int | None = None) -> memoryview:
        """The first n tokens (all by default) as a flat byte view."""
        if n is None or n >= self._tokens:
            return self._view
        return self._view[: max(n, 0) * TOKEN_BYTES]

    def common_prefix(self, other: PackedTokens) -> int:
        """Length in tokens of the longest common prefix with `other`, at memcmp speed."""
        return common_pages(self._bytes, other._view, 0, TOKEN_BYTES)

    def prefix_of(self, sequence: Sequence[int] | np.ndarray, n: int) -> memoryview:
        """The first n tokens of `sequence`, which starts with these tokens (a request's prompt, then
        its output), packed: these tokens are reused as they are and only the rest is converted, so a
        request's prompt is converted once however often its sequence is cached."""
        if n <= self._tokens:
            return self.view(n)
        return memoryview(b"".join((self._bytes, pack(sequence[self._tokens : n]))))


# What the tree's match and insert take: token ids in any container, or already packed.
Tokens = Sequence[int] | np.ndarray | PackedTokens | Packed


def _numpy_int64(arr: np.ndarray) -> np.ndarray:
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
        raise OverflowError("token ids must fit in int64")  # astype would wrap them
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_buffer(tokens: object) -> memoryview | None:
    """A zero-copy flat byte view of `tokens` if it already is packed int64s, else None."""
    if isinstance(tokens, PackedTokens):
        return tokens.view()
    if isinstance(tokens, bytes):
        return memoryview(tokens)
    if isinstance(tokens, memoryview):
        view = tokens
    elif isinstance(tokens, array):
        if tokens.itemsize != TOKEN_BYTES or tokens.typecode not in "ql":
            return None  # narrower, or unsigned (>= 2**63 would read as negative): converted instead
        view = memoryview(tokens)
    elif isinstance(tokens, np.ndarray):
        if tokens.dtype != np.int64 or tokens.ndim != 1 or not tokens.flags.c_contiguous:
            return None
        view = tokens.data
    else:
        return None
    if view.format == "B" and view.ndim == 1:
        return view  # already a packed byte view (PackedTokens.view, a key)
    if view.format not in _INT64_FORMATS or view.ndim != 1 or not view.c_contiguous:
        return None
    return view.cast("B")


def pack(tokens: Tokens) -> memoryview:
    """`tokens` as a flat byte view of int64 ids: zero-copy when they already are (`bytes` and 'B'-format
    memoryviews are taken to be packed: keys, `PackedTokens.view`), else one C-speed conversion."""
    view = _as_buffer(tokens)
    if view is not None:
        return view
    if hasattr(tokens, "numpy") and hasattr(tokens, "dtype"):  # a CPU torch tensor, without importing torch
        tokens = tokens.numpy()  # type: ignore[union-attr]
    if isinstance(tokens, (np.ndarray, array)):  # an array keeps its element type ('i': int32, 'Q': uint64)
        return _numpy_int64(np.asarray(tokens)).data.cast("B")
    # Python ints, range-checked (OverflowError). NOTE: numpy would truncate a float; ids are ints.
    return np.fromiter(tokens, np.int64, len(tokens)).data.cast("B")  # type: ignore[arg-type]


def num_tokens(key: Packed) -> int:
    return len(key) // TOKEN_BYTES


def key_digest(key: Packed) -> int:
    """A digest of a key that is the same in every process (for identities ranks compare)."""
    return zlib.crc32(key) ^ (num_tokens(key) << 32)


def unpack(key: Packed) -> array:
    """The token ids of a key, as array('q') (a Sequence[int]; numpy reads it without a copy)."""
    out = array("q")
    out.frombytes(key)
    return out


def common_pages(key: bytes, query: memoryview, pos: int, page_bytes: int) -> int:
    """How many leading whole pages of `key` equal `query` from byte offset `pos`. One memcmp when the
    whole key matches (the common case: a cached prefix); else a bisection of memcmps over pages, each
    on the half still undecided, so the cost is O(bytes up to the divergence) plus O(log pages) calls."""
    n = min(len(key), len(query) - pos)
    n -= n % page_bytes
    if n <= 0:
        return 0
    if key.startswith(query[pos : pos + n]):
        return n // page_bytes
    lo, hi = 0, n // page_bytes  # pages [0, lo) are equal; some page in [lo, hi) differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key.startswith(query[pos + lo * page_bytes : pos + mid * page_bytes], lo * page_bytes):
            lo = mid
        else:
            hi = mid
    return lo
