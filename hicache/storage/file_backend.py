"""The default storage backend: one file per object in a local directory (embedded, no server needed).

Layout: <root>/<first 2 key chars>/<key>. Keys lead with a page hash, so the 2-character fan-out spreads
objects over up to 4096 directories (hex: 256) and keeps each directory small.

Writes are atomic: the blob goes to a temp file in the object's own directory (same file system), then
os.replace puts it in place, so a reader sees the whole old object, the whole new one, or nothing. There
is no fsync per object by default: a crash can lose only cache (recomputable), and an object torn by a
crash (a rename that reached the disk before its data did) fails the codec's checksum and is a miss.
fsync=True makes each put durable at disk-flush speed (about 0.4 GB/s on the reference machine vs
page-cache speed without it), for stores that must survive power loss warm. max_bytes caps the
directory's size, least recently used objects going first, and start-up sweeps the temp files a crash
left (file_capacity.py). A full disk makes a put fail with StorageUnavailable: a counted, skipped write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from hicache.errors import UserError
from hicache.storage.backend import (
    Blob,
    BytesLike,
    StorageBackend,
    StorageUnavailable,
    check_key,
    check_keys,
    check_range,
)
from hicache.storage.file_capacity import FileCapacity

logger = logging.getLogger(__name__)

_FANOUT = 2
_FANOUT_DIR_RE = re.compile(rf"[0-9A-Za-z_-]{{{_FANOUT}}}")
# Bytes of directory (st_size) whose listing costs about one stat, measured on ext4 in a VM: a stat 4.3 us,
# a listing 0.74 us per entry of ~130 bytes. Only the speed of exists_prefix depends on it.
_LIST_BYTES_PER_KEY = 768
_DIRECTORY_BLOCK = 4096  # the least st_size of an ext4 directory


def default_storage_dir() -> Path:
    """$XDG_CACHE_HOME/hicache/storage, else ~/.cache/hicache/storage.

    A dedicated subdirectory, not the hicache cache root itself: clear() removes every fan-out directory
    under the root, which must never reach other things kept in ~/.cache/hicache."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says relative paths in these variables are invalid and must be ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "hicache" / "storage"


def open_backend(dir: str | None, max_bytes: int, fsync: bool = False) -> FileBackend:
    """`--hicache-storage-backend file` (registry.py): under `dir` (default: default_storage_dir()), capped
    at `max_bytes` if > 0; `fsync` (extra config): every put synced to disk before it counts."""
    try:
        return FileBackend(dir, fsync=fsync, max_bytes=max_bytes)
    except StorageUnavailable as exc:  # at start-up, an unusable directory is the user's to fix
        raise UserError(str(exc)) from exc


class FileBackend(StorageBackend):
    """Objects as files under `root_dir` (default: default_storage_dir()); see the module docstring."""

    def __init__(
        self, root_dir: str | os.PathLike[str] | None = None, *, fsync: bool = False, max_bytes: int = 0
    ) -> None:
        self.root = Path(root_dir) if root_dir is not None else default_storage_dir()
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._root = os.fspath(self.root.resolve())
            self.capacity = FileCapacity(self._root, _FANOUT_DIR_RE, max_bytes)
        except OSError as exc:
            raise StorageUnavailable(f"cannot use storage directory {self.root}: {exc}") from exc

    def _dir(self, key: str) -> str:
        return os.path.join(self._root, key[:_FANOUT])

    def _path(self, key: str) -> str:
        # check_key admits no '/', '.', NUL or other separator, so the result is always inside the root.
        return os.path.join(self._root, check_key(key)[:_FANOUT], key)

    def touch(self, keys: list[str], at: float | None = None) -> None:
        check_keys(keys)
        if not self.capacity.max_bytes:
            return  # uncapped: last use is never consulted, and a long history's touch is thousands of keys
        for key in keys:
            self.capacity.on_use(self._path(key), at)  # its mtime is its last use (only when capped)

    def exists_prefix(self, keys: list[str]) -> int:
        check_keys(keys)  # every key before touching the disk
        asked = Counter(k[:_FANOUT] for k in keys)
        listings: dict[str, set[str] | None] = {}
        for i, key in enumerate(keys):
            fanout = key[:_FANOUT]
            if fanout not in listings:  # listed when first needed: a miss at page 0 lists one directory
                listings[fanout] = self._listing(fanout, asked[fanout])
            names = listings[fanout]
            if not (key in names if names is not None else os.path.exists(os.path.join(self._root, fanout, key))):
                return i
        return len(keys)

    def _listing(self, fanout: str, asked: int) -> set[str] | None:
        """The names in a fan-out directory, when one listing of it costs less than a stat for each of
        the `asked` keys there (else None: stat them). A listing's cost grows with the directory (its
        st_size, on ext4, tmpfs and btrfs alike), a stat's with the keys, so a store much larger than a
        prompt is still asked key by key (docs/BENCHMARKS.md, "Prompt-length paths")."""
        path = os.path.join(self._root, fanout)
        if asked * _LIST_BYTES_PER_KEY < _DIRECTORY_BLOCK:
            return None  # no directory is that small: not even worth the stat that sizes it
        try:
            if os.stat(path).st_size > asked * _LIST_BYTES_PER_KEY:
                return None
            return set(os.listdir(path))
        except FileNotFoundError:
            return set()  # no object was ever put under this fan-out
        except OSError as exc:
            raise StorageUnavailable(f"listing {path}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        return self._read(key, 0, -1)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        for key in keys:
            check_key(key)  # a bad key fails the whole batch before any I/O
        return [self.get(k) for k in keys]

    def batch_get_into(self, keys: list[str], buffers: Sequence[Sequence[memoryview]]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys for {len(buffers)} buffer lists")
        paths = [self._path(k) for k in keys]
        return [self._read_into(path, bufs) for path, bufs in zip(paths, buffers)]

    def _read_into(self, path: str, buffers: Sequence[memoryview]) -> int | None:
        # One preadv per object straight from the page cache into the caller's memory: no intermediate
        # bytes object, whose fresh pages cost more to fault in than the copy itself.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageUnavailable(f"reading {path}: {exc}") from exc
        self.capacity.on_use(path)
        try:
            size = os.fstat(fd).st_size
            want = min(size, sum(b.nbytes for b in buffers))
            done = os.preadv(fd, buffers, 0)
            while done < want:  # a short read (signal, >2 GiB): continue where it stopped
                n = os.preadv(fd, _after(buffers, done), done)
                if n == 0:
                    return done  # the file shrank under us (not by our writers, which replace): say so
                done += n
            return size
        except OSError as exc:
            raise StorageUnavailable(f"reading {path}: {exc}") from exc
        finally:
            os.close(fd)

    def put(self, key: str, blob: Blob) -> None:
        def write(fd: int) -> int:
            with open(fd, "wb", closefd=False) as f:
                # Each part written as it is: large ones go straight to the kernel, uncopied.
                f.writelines(blob if isinstance(blob, tuple) else (blob,))
                return f.tell()

        self._write_atomically(key, write)

    def _write_atomically(self, key: str, write: Callable[[int], int]) -> None:
        """`write(fd)` into a temp file beside the object (returning the size written), then rename."""
        final = self._path(key)
        directory = self._dir(key)
        # A dot-prefixed name can never be a key (keys have no '.'), so readers and exists never see it.
        tmp = os.path.join(directory, f".{key}.{secrets.token_hex(6)}.tmp")
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            except FileNotFoundError:
                os.makedirs(directory, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                try:
                    size = write(fd)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            if self.fsync:
                _fsync_dir(directory)  # make the rename itself durable
        except OSError as exc:
            raise StorageUnavailable(f"writing {final}: {exc}") from exc
        self.capacity.on_put(size)

    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> None:
        for key, _ in items:
            check_key(key)
        for key, blob in items:
            self.put(key, blob)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        check_range(offset, length)
        return self._read(key, offset, length)

    def _read(self, key: str, offset: int, length: int) -> bytes | None:
        """`length` bytes from `offset` (-1: to the end); None where the object is missing."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageUnavailable(f"reading {path}: {exc}") from exc
        self.capacity.on_use(path)
        return data

    def batch_read_ranges(self, items: Sequence[tuple[str, Sequence[tuple[int, memoryview]]]]) -> list[int | None]:
        paths = [self._path(k) for k, _ in items]
        out: list[int | None] = []
        for path, (_, ranges) in zip(paths, items):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as exc:
                raise StorageUnavailable(f"reading {path}: {exc}") from exc
            self.capacity.on_use(path)
            try:  # one pread per range, at its offset: the bytes between ranges are never read
                out.append(sum(_pread_into(fd, buf, offset) for offset, buf in ranges))
            except OSError as exc:
                raise StorageUnavailable(f"reading {path}: {exc}") from exc
            finally:
                os.close(fd)
        return out

    def batch_put_ranges(self, items: Sequence[tuple[str, int, Sequence[tuple[int, BytesLike]]]]) -> None:
        for key, _, _ in items:
            check_key(key)
        for key, size, parts in items:
            self._write_atomically(key, lambda fd, size=size, parts=parts: _pwrite_parts(fd, size, parts))

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageUnavailable(f"deleting {path}: {exc}") from exc
        self.capacity.on_delete(size)

    def clear(self) -> None:
        # Only fan-out directories: the root may be a user-chosen directory holding other things.
        with os.scandir(self._root) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and _FANOUT_DIR_RE.fullmatch(entry.name):
                    shutil.rmtree(entry.path)
        self.capacity.on_clear()
        logger.info("cleared file storage at %s", self._root)

    def close(self) -> None:
        # Every operation opens and closes its own file: nothing is held between calls.
        pass

    def evictions(self) -> tuple[int, int]:
        return self.capacity.stats.evicted_objects, self.capacity.stats.evicted_bytes

    def take_evicted(self) -> list[str]:
        return self.capacity.take_evicted()


def _after(buffers: Sequence[memoryview], skip: int) -> list[memoryview]:
    """`buffers` with their first `skip` bytes (in order) dropped."""
    out = []
    for buf in buffers:
        if skip >= buf.nbytes:
            skip -= buf.nbytes
            continue
        out.append(buf[skip:])
        skip = 0
    return out


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset` (continuing after short reads); bytes read, less at the end of file."""
    done = 0
    while done < buf.nbytes:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _pwrite_parts(fd: int, size: int, parts: Sequence[tuple[int, BytesLike]]) -> int:
    os.ftruncate(fd, size)
    for offset, part in parts:
        view = memoryview(part).cast("B")
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], offset + done)
    return size


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
