"""Fixtures shared by the storage tests."""

from __future__ import annotations

from tests.storage.redis_server import redis_server

__all__ = ["redis_server"]
