"""UnifiedStore: VerifiedStore's page interface over the unified layout (unified.py, spans.py).

The storage tier hands it one rank's host pages (page_unified: this rank's head groups, each its
layers in order), exactly as it hands VerifiedStore a rank-suffixed page. Here a page becomes the
cells this rank writes (one object each, named by what it holds) and, on the way back, the spans this
rank needs of the objects it overlaps, each read by offset and length straight into its place in the
host page and verified layer by layer. A page is a hit only when every span is there and verifies:
a missing or corrupt object of any cell is a miss for the whole page (the tier's MIN agreement then
makes it one on every rank), never a partial page.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.storage.backend import BytesLike, StorageBackend
from hicache.storage.codec import CorruptObject
from hicache.storage.spans import encode_prefix, prefix_size, verify_span
from hicache.storage.store import VerifiedStore, _writable_bytes
from hicache.storage.unified import Shard, UnifiedNamespace, local_page_bytes, reads, writes


class UnifiedStore(VerifiedStore):
    """One rank's view of the unified store: `shard` is what it holds; `writer`: it writes the cells
    inside its shard (False for a replica that an elected writer covers, e.g. MLA's other TP ranks)."""

    topology_independent = True

    def __init__(
        self, backend: StorageBackend, namespace: UnifiedNamespace, shard: Shard, itemsize: int, writer: bool = True
    ) -> None:
        grid, page_size = namespace.grid, namespace.page_size
        self.unified = namespace
        self.shard = shard
        self.writer = writer
        self.spans = reads(grid, shard, page_size, itemsize)
        self.layer_bytes = grid.layer_bytes(page_size, itemsize)
        own = set(writes(grid, shard)) if writer else set()
        self.written = [s for s in self.spans if s.cell in own]
        super().__init__(backend, namespace, payload_bytes=local_page_bytes(grid, shard, page_size, itemsize))  # type: ignore[arg-type]
        self.reads_bytes_per_page = sum(prefix_size(len(s.cell.layers)) + s.length for s in self.spans)

    def keys(self, page_hashes: Sequence[bytes]) -> list[str]:
        """Every object this rank reads, page major."""
        return [self.unified.object_key(h, s.cell) for h in page_hashes for s in self.spans]

    def exists_prefix(self, page_hashes: Sequence[bytes]) -> int:
        """Leading pages of which every object this rank needs exists (`keys` lists a page's objects together)."""
        return super().exists_prefix(page_hashes) // len(self.spans)

    def put_pages(self, page_hashes: Sequence[bytes], payloads: Sequence[BytesLike]) -> bool:
        if len(page_hashes) != len(payloads):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(payloads)} payloads")
        digest = self.unified.digest
        items: list[tuple[str, int, Sequence[tuple[int, BytesLike]]]] = []
        written = 0
        for page_hash, payload in zip(page_hashes, payloads):
            view = memoryview(payload).cast("B")
            if view.nbytes != self.payload_bytes:
                raise ValueError(f"payload of {view.nbytes} bytes, this store's pages are {self.payload_bytes}")
            for span in self.written:
                key = self.unified.object_key(page_hash, span.cell)
                data = view[span.local_offset : span.local_offset + span.length]
                prefix = encode_prefix(key, digest, data, self.layer_bytes)
                # Positioned parts: header + table at 0, the host page's bytes after them, uncopied.
                items.append((key, len(prefix) + span.length, ((0, prefix), (len(prefix), data))))
                written += len(prefix) + span.length
        if not items:
            return True
        return self._put(lambda: self.backend.batch_put_ranges(items), len(items), written)

    def get_pages_into(self, page_hashes: Sequence[bytes], outs: Sequence[BytesLike]) -> list[bool]:
        """Read this rank's spans of each page straight into `outs[i]` (its host page) and verify them.
        True: every span of the page is there and verified; False: a miss (outs[i] may hold garbage)."""
        if len(page_hashes) != len(outs):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(outs)} destination buffers")
        views = [_writable_bytes(out) for out in outs]
        if any(v.nbytes != self.payload_bytes for v in views):
            raise ValueError(f"destination buffers must hold exactly {self.payload_bytes} bytes")
        keys = self.keys(page_hashes)
        prefixes = [memoryview(bytearray(prefix_size(len(s.cell.layers)))) for _ in page_hashes for s in self.spans]
        items = []
        for i, view in enumerate(views):
            for j, s in enumerate(self.spans):
                k = i * len(self.spans) + j
                dst = view[s.local_offset : s.local_offset + s.length]
                items.append((keys[k], ((0, prefixes[k]), (prefixes[k].nbytes + s.offset, dst))))
        span_keys = [key for key, _ in items]
        sizes = self._fetch(span_keys, lambda: self.backend.batch_read_ranges(items), pages=len(page_hashes))
        out: list[bool] = []
        hits = corrupt = nbytes = span_bytes = 0
        for i, view in enumerate(views):
            good = True
            for j, s in enumerate(self.spans):
                k = i * len(self.spans) + j
                size = sizes[k]
                if size is None:
                    good = False
                    continue
                nbytes += size
                span_bytes += max(0, size - prefixes[k].nbytes)
                try:
                    if size != prefixes[k].nbytes + s.length:
                        raise CorruptObject(f"short object: {size} of {prefixes[k].nbytes + s.length} bytes read")
                    first = s.layers.start - s.cell.layers.start
                    dst = view[s.local_offset : s.local_offset + s.length]
                    verify_span(keys[k], self.unified.digest, prefixes[k], len(s.cell.layers), self.layer_bytes,
                                first, dst)  # fmt: skip
                except CorruptObject as exc:
                    good = False
                    corrupt += 1
                    self._discard_corrupt(keys[k], exc)
            hits += good
            out.append(good)
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += len(page_hashes) - hits
            self._stats.corrupt += corrupt
            self._stats.bytes_read += nbytes
            self._stats.span_bytes_read += span_bytes
        return out

    def get_pages(self, page_hashes: Sequence[bytes]) -> list[memoryview | None]:
        bufs = [memoryview(bytearray(self.payload_bytes)) for _ in page_hashes]
        return [buf if ok else None for buf, ok in zip(bufs, self.get_pages_into(page_hashes, bufs))]
