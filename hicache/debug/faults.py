"""Fault injection.

- Storage (`--debug-storage-fail-rate F --debug-storage-fail-rank R`): a backend wrapper that turns a
  seeded random fraction of page reads into misses on one rank, so tests can show that all ranks then
  agree on the shorter prefix. Existence queries and writes pass through untouched.
- Loads (`--debug-load-fail-rate R`): host -> device loads that fail part way, so tests can show that
  the requests needing them recompute (hicache/cache/failed_loads.py).
"""

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

    def touch(self, keys: list[str], at: float | None = None) -> None:
        self.inner.touch(keys, at)

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

    def take_evicted(self) -> list[str]:
        return self.inner.take_evicted()


class InjectedFault(RuntimeError):
    """A failure fault injection caused (so logs and tests can tell it from a real one)."""


class LoadFaults:
    """--debug-load-fail-rate: which host -> device loads fail, and at which layer (seeded per rank, so
    ranks fail different loads, which is what settling a load by agreement is for)."""

    def __init__(self, fail_rate: float, seed: int) -> None:
        self.fail_rate = fail_rate
        self._rng = random.Random(seed)
        self.injected = 0

    def layer_to_fail(self, num_layers: int) -> int | None:
        """The layer the next load fails at (before copying it), or None for a load that succeeds."""
        if self._rng.random() >= self.fail_rate:
            return None
        self.injected += 1
        return self._rng.randrange(num_layers)

