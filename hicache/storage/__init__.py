"""The storage tier: content-addressed KV pages below host memory (docs/DESIGN.md, "storage").

keys.py names pages (chained page hashes + namespace digest), codec.py wraps each object in a verified
envelope, backend.py states what a store must do, file_backend.py / redis_backend.py are the stores,
registry.py opens one by its name (`--hicache-storage-backend`), and
store.py (VerifiedStore) is what the cache controller calls: page hashes and payloads in and out, faults
turned into counted misses. unified.py is the topology-independent layout (grid, names, spans),
spans.py its per-layer verified envelope, unified_store.py (UnifiedStore) VerifiedStore's interface
over it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.storage.backend import StorageBackend, StorageUnavailable
from hicache.storage.codec import CorruptObject, decode, encode
from hicache.storage.file_backend import FileBackend, default_storage_dir
from hicache.storage.keys import Namespace, pack_u32, page_hashes, salt_seed
from hicache.storage.registry import open_backend
from hicache.storage.store import StorageStats, VerifiedStore
from hicache.storage.unified_store import UnifiedStore

if TYPE_CHECKING:
    from hicache.storage.redis_backend import RedisBackend

__all__ = [
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
    "open_backend",
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
