"""Fixtures shared by the storage tests."""

from __future__ import annotations

from hicache.config import HiCacheConfig
from hicache.storage import StorageBackend, open_backend
from tests.storage.redis_server import redis_server

__all__ = ["opened", "redis_server"]


def opened(backend: str, **flags: object) -> StorageBackend:
    """The store `--hicache-storage-backend backend` with `flags` (HiCacheConfig's hicache_storage_* fields,
    without the prefix) opens: the registry's path, as a server takes it."""
    fields = {f"hicache_storage_{name}": value for name, value in flags.items()}
    return open_backend(HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend=backend, **fields))
