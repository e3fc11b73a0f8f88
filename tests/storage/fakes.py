"""An in-memory StorageBackend that can be switched off, for tests of code above the backends (the
VerifiedStore here; the cache controller's prefetch and write-back later) without files or a server."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hicache.storage.backend import Blob, StorageBackend, StorageUnavailable, check_key, check_range, join_blob


class DictBackend(StorageBackend):
    """Objects in a dict. `available = False` makes every call raise StorageUnavailable, like a server
    that is down; `calls` counts backend calls by method name."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.available = True
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _enter(self, method: str, keys: list[str]) -> None:
        for key in keys:
            check_key(key)
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
        if not self.available:
            raise StorageUnavailable("DictBackend switched off")

    def exists_prefix(self, keys: list[str]) -> int:
        self._enter("exists_prefix", keys)
        for i, key in enumerate(keys):
            if key not in self.objects:
                return i
        return len(keys)

    def get(self, key: str) -> bytes | None:
        self._enter("get", [key])
        return self.objects.get(key)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        self._enter("batch_get", keys)
        return [self.objects.get(k) for k in keys]

    def put(self, key: str, blob: Blob) -> None:
        self._enter("put", [key])
        self.objects[key] = bytes(join_blob(blob))

    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> None:
        self._enter("batch_put", [k for k, _ in items])
        for key, blob in items:
            self.objects[key] = bytes(join_blob(blob))

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        check_range(offset, length)
        self._enter("get_range", [key])
        blob = self.objects.get(key)
        return None if blob is None else blob[offset : offset + length]

    def delete(self, key: str) -> None:
        self._enter("delete", [key])
        self.objects.pop(key, None)

    def clear(self) -> None:
        self._enter("clear", [])
        self.objects.clear()

    def close(self) -> None:
        pass
