"""A real, throwaway redis-server for tests (and benchmarks): its own port, its own directory, no
persistence unless asked for, stopped by pid. stop()/start() simulate an outage and a restart on the
same port (which keeps the data only with `persist=True`).

    from tests.storage.redis_server import RedisServer, redis_server  # the class and a pytest fixture

    with RedisServer(tmp_path) as server:
        backend = RedisBackend(server.url)

A missing redis-server fails loudly (run `make redis`) instead of skipping: the Redis backend is part
of what CI must prove works.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0


class RedisServerError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server subprocess on `host` (127.0.0.1; another host's address where the caller starts it
    from that host's network namespace, tests/fleet/netns.py). The port is chosen at the first start and kept across
    stop()/start(), so clients' URLs stay valid through a restart (with an empty store: no persistence)."""

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        executable: str = "redis-server",
        persist: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        """`persist`: an append-only file synced at every write, so a restart keeps what was stored (a
        production server's setting; tests of an outage that loses the data leave it off)."""
        path = shutil.which(executable)
        if path is None:
            raise RedisServerError(f"{executable} is not on PATH; install it with `make redis`")
        self.executable = path
        self.persist = persist
        self.host = host
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="hicache-redis-") if workdir is None else workdir)
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("the server has not been started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's process id (to pause it with SIGSTOP, simulating a hung server)."""
        if self._proc is None:
            raise RedisServerError("the server is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        # A port free a moment ago can be taken before redis binds it: retry with a new one, except on a
        # restart, where the URL must not change.
        attempts = 3 if self.port is None else 1
        for attempt in range(attempts):
            port = self.port if self.port is not None else _free_port()
            try:
                self._launch(port)
            except RedisServerError:
                if attempt == attempts - 1:
                    raise
                continue
            self.port = port
            return

    def _launch(self, port: int) -> None:
        log = self.workdir / f"redis-{port}.log"
        cmd = [
            self.executable,
            "--port", str(port),
            "--bind", self.host,
            "--protected-mode", "no",  # without a password it would answer another host with DENIED
            "--save", "",
            "--appendonly", "yes" if self.persist else "no",
            "--appendfsync", "always",
            "--dir", str(self.workdir),
            "--logfile", str(log),
        ]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RedisServerError(f"redis-server exited with {proc.returncode} on port {port}: {err}{tail}")
            if _ping(self.host, port):
                self._proc = proc
                return
            time.sleep(0.02)
        self._terminate(proc)
        raise RedisServerError(f"redis-server did not answer PING on port {port} within {_START_TIMEOUT_S} s")

    def stop(self) -> None:
        """Stop this server (only the process this object started), leaving the port free."""
        if self._proc is not None:
            self._terminate(self._proc)
            self._proc = None

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh server per test; the test may stop() and start() it."""
    try:
        server = RedisServer(tmp_path)
    except RedisServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server
