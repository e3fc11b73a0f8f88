"""The storage backends by name (docs/DESIGN.md, "storage"): what `--hicache-storage-backend NAME` opens.

A backend is one module: its `StorageBackend` (backend.py's contract) and an `open_backend(**options)`
function, registered below by one line: its name, its module (imported only when a store of it opens, so
a server without Redis never imports redis-py) and the `--hicache-storage-*` flags it reads, passed by
their names without the prefix (`--hicache-storage-dir` as `dir`). Options of its own come as SGLang
passes them, in `--hicache-storage-backend-extra-config` (a JSON object, keyword arguments of its
`open_backend`): no flag or config field to add. A flag set for a backend that does not read it, or an
extra option it does not take, is a one-line error, not a silently ignored setting.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from hicache.errors import UserError, json_object

if TYPE_CHECKING:
    from hicache.storage.backend import StorageBackend

FLAG_PREFIX = "hicache_storage_"


@dataclass(frozen=True)
class Registered:
    name: str
    module: str  # holds `open_backend(**options) -> StorageBackend`
    reads: tuple[str, ...]  # the --hicache-storage-* flags it takes, without the prefix


BACKENDS = {
    backend.name: backend
    for backend in (
        Registered("file", "hicache.storage.file_backend", ("dir", "max_bytes")),
        Registered("redis", "hicache.storage.redis_backend", ("url", "idle_ttl")),
    )
}


def flag(option: str) -> str:
    return "--" + (FLAG_PREFIX + option).replace("_", "-")


def check(cfg: Any) -> None:
    """Raise UserError unless `cfg` (a HiCacheConfig) names a registered backend (or none), sets only the
    backend flags it reads (away from their defaults), and extra options it takes."""
    name = cfg.hicache_storage_backend
    if name is not None and name not in BACKENDS:
        raise UserError(f"--hicache-storage-backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    defaults = {f.name: f.default for f in fields(cfg)}
    reads = BACKENDS[name].reads if name is not None else ()
    for backend in BACKENDS.values():
        for option in backend.reads:
            field = FLAG_PREFIX + option
            if option not in reads and getattr(cfg, field) != defaults[field]:
                readers = " or ".join(b.name for b in BACKENDS.values() if option in b.reads)
                raise UserError(f"{flag(option)} applies to --hicache-storage-backend {readers} only")
    extra = extra_options(cfg.hicache_storage_backend_extra_config)
    if extra and name is None:
        raise UserError("--hicache-storage-backend-extra-config needs --hicache-storage-backend")
    check_extra(name, extra)


def extra_options(text: str | None) -> dict[str, Any]:
    """`--hicache-storage-backend-extra-config`'s JSON object (empty when not given)."""
    if not text:
        return {}
    return json_object(text, "--hicache-storage-backend-extra-config")


def own_options(name: str) -> list[str]:
    """The options backend `name` takes in its extra config: its `open_backend`'s beyond the flags."""
    backend = BACKENDS[name]
    opener = importlib.import_module(backend.module).open_backend
    return [option for option in inspect.signature(opener).parameters if option not in backend.reads]


def check_extra(name: str, extra: dict[str, Any]) -> None:
    """Raise UserError if backend `name` does not take every option of `extra`."""
    own = own_options(name) if extra else []
    if unknown := sorted(set(extra) - set(own)):
        flags_named = ", ".join(map(flag, BACKENDS[name].reads))
        raise UserError(f"the {name} storage backend takes no extra option {unknown[0]!r} "
                        f"(its own: {', '.join(own) or 'none'}; {flags_named} are flags)")  # fmt: skip


def open_backend(cfg: Any) -> StorageBackend:
    """The store `cfg` (a HiCacheConfig) names: its backend's flags and extra options passed to its
    module's `open_backend`."""
    backend = BACKENDS[cfg.hicache_storage_backend]
    extra = extra_options(cfg.hicache_storage_backend_extra_config)
    check_extra(backend.name, extra)
    flags = {option: getattr(cfg, FLAG_PREFIX + option) for option in backend.reads}
    return importlib.import_module(backend.module).open_backend(**flags, **extra)
