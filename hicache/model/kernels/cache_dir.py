"""Where the kernels keep what outlives a process: measured linear plans (calibration.py) and the
native kernel's build (native.py)."""

from __future__ import annotations

import os
import pathlib


def default_cache_dir() -> pathlib.Path:
    """$HICACHE_CACHE_DIR, else $XDG_CACHE_HOME/hicache, else ~/.cache/hicache."""
    if os.environ.get("HICACHE_CACHE_DIR"):
        return pathlib.Path(os.environ["HICACHE_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (pathlib.Path(xdg) if os.path.isabs(xdg) else pathlib.Path.home() / ".cache") / "hicache"
