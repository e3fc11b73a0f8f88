"""The storage tier: content-addressed KV pages below host memory (docs/DESIGN.md, "storage").

keys.py names pages (chained page hashes + namespace digest), codec.py wraps each object in a verified
envelope, backend.py states what a store must do, file_backend.py / redis_backend.py are the stores, and
store.py (VerifiedStore) is what the cache controller calls: page hashes and payloads in and out, faults
turned into counted misses. unified.py is the topology-independent layout (grid, names, spans),
spans.py its per-layer verified envelope, unified_store.py (UnifiedStore) VerifiedStore's interface
over it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hicache.errors import UserError
from hicache.storage.backend import StorageBackend, StorageUnavailable
from hicache.storage.codec import CorruptObject, decode, encode
from hicache.storage.file_backend import FileBackend, default_storage_dir
from hicache.storage.keys import Namespace, pack_u32, page_hashes, salt_seed
from hicache.storage.store import StorageStats, VerifiedStore
from hicache.storage.unified_store import UnifiedStore

if TYPE_CHECKING:
    from hicache.storage.redis_backend import RedisBackend

BACKEND_KINDS = ("file", "redis")

__all__ = [
    "BACKEND_KINDS",
    "CorruptObject",
    "FileBackend",
    "Namespace",
    "RedisBackend",
    "StorageBackend",
    "StorageStats",
    "StorageUnavailable",
    "UnifiedStore",
    "VerifiedStore",
    "decode",
    "default_storage_dir",
    "encode",
    "make_backend",
    "pack_u32",
    "page_hashes",
    "salt_seed",
]


def __getattr__(name: str) -> type:  # PEP 562: RedisBackend, loaded on first use
    """redis-py is imported where a Redis store is used, not by every process that imports hicache: it is
    about 0.3 s of each server's and rank's start."""
    if name == "RedisBackend":
        from hicache.storage.redis_backend import RedisBackend

        return RedisBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_backend(
    kind: str,
    storage_dir: str | os.PathLike[str] | None = None,
    url: str | None = None,
    max_bytes: int = 0,
    idle_ttl_s: float = 0.0,
) -> StorageBackend:
    """The backend for `--hicache-storage-backend kind`: "file" (under storage_dir, default
    default_storage_dir(), capped at max_bytes if > 0) or "redis" (at url, default
    redis://127.0.0.1:6379/0; objects expire idle_ttl_s after their last use if > 0). Connections are
    lazy: an unreachable Redis is reported by the first operation as StorageUnavailable, not here."""
    if kind == "file":
        try:
            return FileBackend(storage_dir, max_bytes=max_bytes)
        except StorageUnavailable as exc:  # at start-up, an unusable directory is the user's to fix
            raise UserError(str(exc)) from exc
    if kind == "redis":
        from hicache.storage.redis_backend import DEFAULT_URL, RedisBackend

        try:
            return RedisBackend(url or DEFAULT_URL, idle_ttl_s=idle_ttl_s)
        except ValueError as exc:
            raise UserError(f"invalid Redis URL {url!r}: {exc}") from exc
    raise UserError(f"unknown storage backend {kind!r}; choose one of {', '.join(BACKEND_KINDS)}")
