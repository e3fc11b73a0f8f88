"""VerifiedStore: pages in, pages out, never a wrong byte and never an exception for a storage fault.

This is the storage tier's face to the cache controller. It turns page hashes into object keys (the
namespace), wraps payloads in the codec's envelope on the way out and verifies them on the way back,
and converts every storage fault (absent, corrupt, unreachable) into a counted miss. A page it returns
is exactly the payload that was stored for that page hash in this namespace.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TypeVar

from hicache.storage.backend import Blob, StorageBackend, StorageUnavailable
from hicache.storage.codec import HEADER_SIZE, BytesLike, CorruptObject, decode, encode_parts, verify_parts
from hicache.storage.keys import HASH_BYTES, Namespace

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class StorageStats:
    """Counters since the store was created (read them through VerifiedStore.stats, a snapshot).

    gets/hits/misses/corrupt count pages; misses include corrupt pages and pages not read because the
    store was unavailable. puts counts pages written. bytes_read/bytes_written count whole objects moved
    (header included), i.e. the traffic the backend carried. errors counts backend operations that
    failed with StorageUnavailable (one per failed call, however many pages it covered). evicted_objects
    and evicted_bytes count what the backend removed to stay under its size cap (the file backend's
    --hicache-storage-max-bytes)."""

    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    puts: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    evicted_objects: int = 0
    evicted_bytes: int = 0
    span_bytes_read: int = 0  # unified layout: data bytes of the spans read (headers and tables not counted)


class VerifiedStore:
    """Page-level access to a StorageBackend under one Namespace. Thread-safe if the backend is.

    `payload_bytes`, when given, is the exact size of every page's payload (bytes per token x page
    size for the namespace's layout); a stored object of another size is treated as corrupt rather than
    handed to a copy that would overrun or underfill a host page."""

    topology_independent = False  # keys name the writer's shard (a UnifiedStore's do not)

    def __init__(self, backend: StorageBackend, namespace: Namespace, payload_bytes: int | None = None) -> None:
        if payload_bytes is not None and payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be positive, got {payload_bytes}")
        self.backend = backend
        self.namespace = namespace
        self.payload_bytes = payload_bytes
        self._stats = StorageStats()
        self._lock = threading.Lock()
        self._available = True  # only to log outage transitions once, not once per call

    @property
    def available(self) -> bool:
        """Whether the last call reached the backend (a write that failed waits for this to retry)."""
        with self._lock:
            return self._available

    @property
    def stats(self) -> StorageStats:
        objects, nbytes = self.backend.evictions()
        with self._lock:
            return replace(self._stats, evicted_objects=objects, evicted_bytes=nbytes)

    def keys(self, page_hashes: Sequence[bytes]) -> list[str]:
        return [self.namespace.object_key(h) for h in page_hashes]

    @cached_property
    def _key_tails(self) -> frozenset[str]:
        """What follows the page hash in each of a page's keys (the namespace's, and a unified cell's)."""
        return frozenset(key[2 * HASH_BYTES :] for key in self.keys([bytes(HASH_BYTES)]))

    def pages_of(self, keys: Sequence[str]) -> list[bytes]:
        """The page hashes of those `keys` that are this store's objects (others' are dropped)."""
        return [bytes.fromhex(key[: 2 * HASH_BYTES]) for key in keys if key[2 * HASH_BYTES :] in self._key_tails]

    def exists_prefix(self, page_hashes: Sequence[bytes]) -> int:
        """How many leading pages the store holds (0 when it is unreachable). Existence is not validity:
        a page counted here can still come back None from get_pages."""
        try:
            found = self.backend.exists_prefix(self.keys(page_hashes))
        except StorageUnavailable as exc:
            self._unavailable("exists_prefix", exc)
            return 0
        self._reachable()
        return found

    def touch(self, page_hashes: Sequence[bytes], at: float | None = None) -> None:
        """Mark the stored pages used now, or at `at` (StorageBackend.touch); an unavailable store is not an
        error here: the put beside it finds out and counts it."""
        try:
            self.backend.touch(self.keys(page_hashes), at)
        except StorageUnavailable:
            pass

    def put_pages(self, page_hashes: Sequence[bytes], payloads: Sequence[BytesLike]) -> bool:
        """Store each payload under its page hash. True if the backend took the batch; False (counted,
        logged) if the store was unavailable, in which case some pages may or may not have been written."""
        if len(page_hashes) != len(payloads):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(payloads)} payloads")
        digest = self.namespace.digest
        items: list[tuple[str, Blob]] = []
        written = 0
        for page_hash, payload in zip(page_hashes, payloads):
            size = memoryview(payload).nbytes
            if self.payload_bytes is not None and size != self.payload_bytes:
                raise ValueError(f"payload of {size} bytes, this store's pages are {self.payload_bytes}")
            # Header and payload travel as parts: a file backend writes them without copying the payload.
            items.append((self.namespace.object_key(page_hash), encode_parts(page_hash, digest, payload)))
            written += HEADER_SIZE + size
        return self._put(lambda: self.backend.batch_put(items), len(items), written)

    def _put(self, put: Callable[[], None], objects: int, written: int) -> bool:
        """Run a backend write of `objects` objects, `written` bytes: counted, or (False) the store
        was unavailable (counted, logged)."""
        try:
            put()
        except StorageUnavailable as exc:
            self._unavailable("put", exc)
            return False
        self._reachable()
        with self._lock:
            self._stats.puts += objects
            self._stats.bytes_written += written
        return True

    def get_pages(self, page_hashes: Sequence[bytes]) -> list[memoryview | None]:
        """The verified payload of each page (a zero-copy view into the fetched object) or None for a
        page that is absent, corrupt, the wrong size, or unreadable because the store is unavailable.
        Callers use the leading run of non-None pages; a corrupt object is deleted so it can be rewritten."""
        keys = self.keys(page_hashes)
        blobs = self._fetch(keys, lambda: self.backend.batch_get(keys))
        digest = self.namespace.digest

        def verify(blob: bytes, page_hash: bytes) -> memoryview:
            payload = decode(blob, page_hash, digest)
            if self.payload_bytes is not None and payload.nbytes != self.payload_bytes:
                raise CorruptObject(f"payload is {payload.nbytes} bytes, expected {self.payload_bytes}")
            return payload

        return self._verify_all(keys, page_hashes, blobs, verify, len)

    def get_pages_into(self, page_hashes: Sequence[bytes], outs: Sequence[BytesLike]) -> list[bool]:
        """Read each page's payload straight into `outs[i]` (a writable buffer of exactly the page's
        payload size, e.g. a host-pool page) and verify it there. True for a verified hit; False for a
        miss, in which case outs[i] may hold garbage and must not be used. Counted as get_pages counts.
        From a file store this is copy-free (one preadv per page); other backends copy once."""
        if len(page_hashes) != len(outs):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(outs)} destination buffers")
        views = [_writable_bytes(out) for out in outs]
        if self.payload_bytes is not None and any(v.nbytes != self.payload_bytes for v in views):
            raise ValueError(f"destination buffers must hold exactly {self.payload_bytes} bytes")
        keys = self.keys(page_hashes)
        headers = [memoryview(bytearray(HEADER_SIZE)) for _ in keys]
        sizes = self._fetch(keys, lambda: self.backend.batch_get_into(keys, list(zip(headers, views))))
        digest = self.namespace.digest
        reads = [None if size is None else (size, header, view) for size, header, view in zip(sizes, headers, views)]

        def verify(read: tuple[int, memoryview, memoryview], page_hash: bytes) -> bool:
            size, header, view = read
            verify_parts(header, view, size, page_hash, digest)
            return True

        def nbytes(read: tuple[int, memoryview, memoryview]) -> int:
            return min(read[0], HEADER_SIZE + read[2].nbytes)  # what was actually transferred

        return [hit is not None for hit in self._verify_all(keys, page_hashes, reads, verify, nbytes)]

    def _fetch(self, keys: list[str], read: Callable[[], list[T | None]], pages: int | None = None) -> list[T | None]:
        """Run one backend read for `keys` (of `pages` pages; one key a page by default); an outage makes
        every key a (counted) miss."""
        with self._lock:
            self._stats.gets += len(keys) if pages is None else pages
        try:
            result = read()
        except StorageUnavailable as exc:
            self._unavailable("get", exc)
            return [None] * len(keys)
        self._reachable()
        return result

    def _verify_all(
        self,
        keys: list[str],
        page_hashes: Sequence[bytes],
        fetched: list[T | None],
        verify: Callable[[T, bytes], R],
        size: Callable[[T], int],
    ) -> list[R | None]:
        out: list[R | None] = []
        hits = corrupt = nbytes = 0
        for key, page_hash, item in zip(keys, page_hashes, fetched):
            if item is None:
                out.append(None)
                continue
            nbytes += size(item)
            try:
                out.append(verify(item, page_hash))
            except CorruptObject as exc:
                corrupt += 1
                out.append(None)
                self._discard_corrupt(key, exc)
                continue
            hits += 1
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
            self._stats.corrupt += corrupt
            self._stats.bytes_read += nbytes
        return out

    def _discard_corrupt(self, key: str, exc: CorruptObject) -> None:
        # Left in place, a corrupt object would count as present in exists_prefix forever and a writer
        # that skips existing pages would never replace it. Pages are content-addressed, so deleting is
        # safe even when the store is shared: no reader can use these bytes.
        logger.warning("corrupt storage object %s (%s): deleting it, counted as a miss", key, exc.reason)
        try:
            self.backend.delete(key)
        except StorageUnavailable as delete_exc:
            self._unavailable("delete", delete_exc)

    def _unavailable(self, op: str, exc: StorageUnavailable) -> None:
        with self._lock:
            self._stats.errors += 1
            was_available, self._available = self._available, False
        if was_available:
            logger.warning("storage unavailable (%s): %s; treating storage as a miss until it is back", op, exc)
        else:
            logger.debug("storage still unavailable (%s): %s", op, exc)

    def _reachable(self) -> None:
        with self._lock:
            was_available, self._available = self._available, True
        if not was_available:
            logger.info("storage is reachable again")


def _writable_bytes(buf: BytesLike) -> memoryview:
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("destination buffers must be writable")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
