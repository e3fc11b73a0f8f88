"""The storage tier's backend contract: a flat key -> bytes store, the last tier below host memory.

Backends move opaque blobs (already wrapped by `codec`); they know nothing about pages, hashes or
verification. `VerifiedStore` (store.py) is the only intended caller: it names objects, encodes, decodes,
verifies and counts. Keeping backends this dumb is what lets a file directory, a Redis server or a future
remote store be swapped without touching the cache controller.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Sequence

from hicache.storage.codec import BytesLike

# An object to store: one buffer, or a tuple of buffers stored back to back as one object. The tuple
# form lets a backend that can write scattered buffers (files: header, then payload) skip a copy.
Blob = BytesLike | tuple[BytesLike, ...]

# Keys are produced by Namespace.object_key (hex, '_' and, for unified-layout chunks, '-'); anything
# else is a bug or an attack. The length cap keeps every key a valid file name (255 bytes on ext4).
_KEY_RE = re.compile(r"[0-9A-Za-z_-]{2,200}")


class StorageUnavailable(Exception):
    """The backend cannot reach or use its store right now (server down, timeout, disk full, I/O error).

    Transient by assumption: callers count it, treat the operation as a miss (or a skipped write) and try
    again on the next operation; a backend must recover by itself once the store is back."""


def join_blob(blob: Blob) -> BytesLike:
    """`blob` as one buffer (copying only when it comes in parts), for stores that take a single value."""
    return b"".join(blob) if isinstance(blob, tuple) else blob


def scatter(blob: BytesLike, buffers: Sequence[memoryview]) -> int:
    """Copy `blob` into `buffers` in order, as far as either goes; return len(blob)."""
    view = memoryview(blob)
    offset = 0
    for buf in buffers:
        n = min(buf.nbytes, view.nbytes - offset)
        if n <= 0:
            break
        buf[:n] = view[offset : offset + n]
        offset += n
    return view.nbytes


def check_key(key: str) -> str:
    """`key` unchanged if it is a valid object key, else ValueError (never a path, never an escape)."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ValueError(f"invalid storage key {key!r}: expected 2-200 characters from [0-9A-Za-z_-]")
    return key


def check_keys(keys: Sequence[str]) -> None:
    """ValueError naming the first invalid key of `keys`, if any: one C-level pass over a batch (a
    prompt's thousands of keys), and `check_key`'s message for the one that fails."""
    try:
        if all(map(_KEY_RE.fullmatch, keys)):
            return
    except TypeError:
        pass  # not a str: check_key below names it
    for key in keys:
        check_key(key)


class StorageBackend(abc.ABC):
    """A key -> blob store.

    Contract every implementation keeps:
    - Keys match [0-9A-Za-z_-]{2,200} (check_key); an invalid key raises ValueError before any I/O.
    - A put is atomic: a reader sees the old object, the new one or none, never a mix or a prefix.
      Objects are immutable by convention (content-addressed), so a re-put of a key writes the same bytes.
    - Missing objects are None (or 0 for exists_prefix), never an exception.
    - Failing to reach the store raises StorageUnavailable, within a bounded time (about a second per
      round trip), and the next call tries again: there is no sticky broken state.
    - Data is not verified here; a backend may return a torn or foreign object and `codec.decode` catches it.
    - Methods are safe to call from several threads at once (the controller's I/O workers).
    """

    @abc.abstractmethod
    def exists_prefix(self, keys: list[str]) -> int:
        """How many leading `keys` exist: stops at the first missing one, in as few round trips as the
        store allows (one batched query per chunk). Existence only; the object may still fail to verify."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The whole object, or None if absent."""

    @abc.abstractmethod
    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        """`get` for each key, batched; results in key order."""

    def batch_get_into(self, keys: list[str], buffers: Sequence[Sequence[memoryview]]) -> list[int | None]:
        """Read each object straight into its caller-owned buffers (scattered in order: e.g. a 64-byte
        header buffer, then a host-pool page) and return its full stored size, or None if absent.
        Bytes past the buffers are not read; buffers past the object's end keep their old contents, so
        callers compare the size with what they expected. Buffers are flat byte memoryviews.

        The default fetches and copies; a backend that can read into memory directly (files: preadv;
        an RDMA store: registered buffers) overrides it to skip the intermediate object."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys for {len(buffers)} buffer lists")
        return [None if blob is None else scatter(blob, bufs) for blob, bufs in zip(self.batch_get(keys), buffers)]

    @abc.abstractmethod
    def put(self, key: str, blob: Blob) -> None:
        """Store `blob` under `key`, replacing any object there, atomically."""

    @abc.abstractmethod
    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> None:
        """`put` for each (key, blob), batched. Each object is atomic on its own; the batch is not."""

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        """Bytes [offset, offset+length) of the object (shorter if it ends first), or None if absent.
        For readers that need only a slice of an object (unified layout: a layer range of a page)."""

    def batch_read_ranges(self, items: Sequence[tuple[str, Sequence[tuple[int, memoryview]]]]) -> list[int | None]:
        """Positioned reads: for each (key, [(offset, buffer), ...]) fill each buffer with the object's
        bytes from `offset` on, and return how many bytes were read in all (less than the buffers hold
        when the object ends first: callers compare), or None if the object is absent. Only the
        ranges move, never the whole object. The default is one get_range per range."""
        out: list[int | None] = []
        for key, ranges in items:
            total: int | None = 0
            for offset, buf in ranges:
                data = self.get_range(key, offset, buf.nbytes)
                if data is None:
                    total = None
                    break
                buf[: len(data)] = data
                total += len(data)
            out.append(total)
        return out

    def batch_put_ranges(self, items: Sequence[tuple[str, int, Sequence[tuple[int, BytesLike]]]]) -> None:
        """Positioned writes: for each (key, size, [(offset, part), ...]) store an object of `size`
        bytes with each part at its offset (gaps are zeros), atomically as `put` is. Lets a writer lay
        out an object from pieces (header, checksum table, a view of its host page) without joining
        them first. The default joins them and puts."""
        joined = []
        for key, size, parts in items:
            blob = bytearray(size)
            for offset, part in parts:
                view = memoryview(part).cast("B")
                blob[offset : offset + view.nbytes] = view
            joined.append((key, bytes(blob)))
        self.batch_put(joined)

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object if present."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every object this backend owns (tests, `/flush_cache`-style resets)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and handles. The backend is unusable afterwards."""

    def touch(self, keys: list[str], at: float | None = None) -> None:
        """Mark the objects under `keys` (those present) used now, or at the wall-clock time `at` when
        later than their last use, for a store that evicts the least recently used: a page's ancestors are
        touched after it is put, so a chain ages from its tail and a prefix's first pages, which every later
        turn needs, are not the first to go (docs/DESIGN.md, "storage"); a retained page is touched at the
        end of its retention, a use in the future ("retention hints"). The default does nothing: a store
        without a cap of its own."""

    def evictions(self) -> tuple[int, int]:
        """(objects, bytes) the backend removed to stay under a size cap of its own; (0, 0) for a store
        that has none (Redis evicts by its own maxmemory policy, which it reports itself)."""
        return 0, 0

    def take_evicted(self) -> list[str]:
        """The keys the backend removed to stay under a size cap of its own since the last call (for the
        KV events: a page gone from storage); [] for a store that has none."""
        return []

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_range(offset: int, length: int) -> None:
    """ValueError for a range no backend can serve."""
    if offset < 0 or length < 0:
        raise ValueError(f"invalid range: offset {offset}, length {length}")
