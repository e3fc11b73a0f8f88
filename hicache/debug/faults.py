"""Storage fault injection (`--debug-storage-fail-rate F --debug-storage-fail-rank R`): a backend wrapper
that turns a seeded random fraction of page reads into misses on one rank, so tests can show that all
ranks then agree on the shorter prefix. Existence queries and writes pass through untouched."""

from __future__ import annotations

import random
import threading
from typing import Sequence

from hicache.storage.backend import Blob, StorageBackend


class FlakyReads(StorageBackend):
    def __init__(self, inner: StorageBackend, fail_rate: float, seed: int) -> None:
        self.inner = inner
        self.fail_rate = fail_rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # backends are called from several threads
        self.injected = 0

    def _fails(self) -> bool:
        with self._lock:
            failed = self._rng.random() < self.fail_rate
            self.injected += failed
            return failed

    def exists_prefix(self, keys: list[str]) -> int:
        return self.inner.exists_prefix(keys)

    def get(self, key: str) -> bytes | None:
        return None if self._fails() else self.inner.get(key)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        return [None if self._fails() else blob for blob in self.inner.batch_get(keys)]

    def batch_get_into(self, keys: list[str], buffers: Sequence[Sequence[memoryview]]) -> list[int | None]:
        return [None if self._fails() else size for size in self.inner.batch_get_into(keys, buffers)]

    def put(self, key: str, blob: Blob) -> None:
        self.inner.put(key, blob)

    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> None:
        self.inner.batch_put(items)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        return None if self._fails() else self.inner.get_range(key, offset, length)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self.inner.close()

    def evictions(self) -> tuple[int, int]:
        return self.inner.evictions()
