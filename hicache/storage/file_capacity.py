"""A size cap for the file backend (docs/DESIGN.md, "storage"): `--hicache-storage-max-bytes`.

The directory itself is the index. An object's last use is its mtime: a put writes it, and a read of a
capped store touches it (`os.utime`), so it works on file systems mounted noatime and across several
servers sharing one directory. A retention hint (docs/DESIGN.md, "retention hints") is a time credit: a
retained page counts as used at the end of its retention, an mtime in the future, so the pass takes it
after every page used before then; no use moves an mtime back, so a read does not take the credit away.
The backend keeps a running estimate of the bytes stored (a scan at start-up plus its own puts); when the estimate passes the cap, one eviction pass scans the directory
(the true total, other writers' objects included), then deletes the least recently used objects until
the total is under LOW_WATERMARK of the cap. Objects are immutable and content-addressed, so deleting
one only ever turns a later read into a miss.

Start-up also sweeps temp files older than STALE_TMP_S that a crash left behind (a writer renames its
temp file within milliseconds; one that old belongs to no live writer).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LOW_WATERMARK = 0.9  # an eviction pass frees down to this fraction of the cap, so passes stay rare
# Evicted keys kept for the KV events until taken (take_evicted): a bound for a store nobody asks, whose
# oldest keys are then dropped (a subscriber's index keeps those pages: a worse route, never a wrong answer).
MAX_UNREPORTED_EVICTIONS = 1 << 20
STALE_TMP_S = 60.0


@dataclass(frozen=True)
class StoredObject:
    path: str
    size: int
    last_used: float


@dataclass
class CapacityStats:
    evicted_objects: int = 0
    evicted_bytes: int = 0
    eviction_passes: int = 0
    swept_tmp_files: int = 0


def scan(root: str, fanout_dir: re.Pattern[str]) -> tuple[list[StoredObject], list[StoredObject]]:
    """(objects, temp files) under the fan-out directories of `root`."""
    objects, temps = [], []
    with os.scandir(root) as dirs:
        for d in dirs:
            if not (d.is_dir(follow_symlinks=False) and fanout_dir.fullmatch(d.name)):
                continue
            with os.scandir(d.path) as entries:
                for e in entries:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed by another writer meanwhile
                    item = StoredObject(e.path, st.st_size, st.st_mtime)
                    (temps if e.name.startswith(".") else objects).append(item)
    return objects, temps


class FileCapacity:
    """Keeps one file-backend directory under `max_bytes` (0: no cap, and nothing is tracked)."""

    def __init__(self, root: str, fanout_dir: re.Pattern[str], max_bytes: int) -> None:
        self.root = root
        self.fanout_dir = fanout_dir
        self.max_bytes = max_bytes
        self.stats = CapacityStats()
        self._evicted: deque[str] = deque(maxlen=MAX_UNREPORTED_EVICTIONS)  # keys: appended by a pass
        self._lock = threading.Lock()
        objects, temps = scan(root, fanout_dir)
        now = time.time()
        for tmp in temps:
            if now - tmp.last_used > STALE_TMP_S:
                self._remove(tmp.path)
                self.stats.swept_tmp_files += 1
        if self.stats.swept_tmp_files:
            logger.info("swept %d stale temp files from %s", self.stats.swept_tmp_files, root)
        self._estimate = sum(o.size for o in objects)
        if max_bytes:
            logger.info("file storage %s: %.1f MB stored, cap %.1f MB", root, self._estimate / 1e6, max_bytes / 1e6)
            self._evict_if_over()

    def on_put(self, size: int) -> None:
        if not self.max_bytes:
            return
        with self._lock:
            self._estimate += size
        self._evict_if_over()

    def on_use(self, path: str, at: float | None = None) -> None:
        """The object was used (read, or touched) at `at` (None: now); only when capped, as otherwise last
        use is never consulted. Never back: an mtime past `at` is a retention credit, kept."""
        if self.max_bytes:
            at = time.time() if at is None else at
            try:
                if os.stat(path).st_mtime < at:
                    os.utime(path, (at, at))
            except OSError:
                pass  # deleted meanwhile, or a read-only store: the object just ages as if unread

    def on_delete(self, size: int) -> None:
        if self.max_bytes:
            with self._lock:
                self._estimate = max(0, self._estimate - size)

    def take_evicted(self) -> list[str]:
        """The keys eviction passes removed since the last call (thread-safe: a deque's ends are atomic)."""
        evicted = self._evicted
        return [evicted.popleft() for _ in range(len(evicted))]

    def on_clear(self) -> None:
        with self._lock:
            self._estimate = 0

    def _evict_if_over(self) -> None:
        if self._estimate <= self.max_bytes or not self._lock.acquire(blocking=False):
            return  # under the cap, or another thread's pass is already at work
        try:
            objects, _ = scan(self.root, self.fanout_dir)
            total = sum(o.size for o in objects)
            target = int(self.max_bytes * LOW_WATERMARK)
            if total > self.max_bytes:
                self.stats.eviction_passes += 1
                for obj in sorted(objects, key=lambda o: o.last_used):
                    if total <= target:
                        break
                    if self._remove(obj.path):
                        total -= obj.size
                        self._evicted.append(os.path.basename(obj.path))
                        self.stats.evicted_objects += 1
                        self.stats.evicted_bytes += obj.size
            self._estimate = total
        finally:
            self._lock.release()

    @staticmethod
    def _remove(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False  # another server evicted it first
        except OSError as exc:
            logger.warning("could not remove %s: %s", path, exc)
            return False
