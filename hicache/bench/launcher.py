"""Starts and stops `hicache serve` processes for benchmark arms (the `bench` part of the design).

Each arm gets a fresh server on a free 127.0.0.1 port; the benchmark waits for GET /health, and stops
the server by its pid (SIGTERM, then SIGKILL of its own process group if it does not exit). Server output
goes to an anonymous temporary file whose tail is shown when the server fails to start.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO

import httpx

from hicache.engine.launch import free_port
from hicache.errors import UserError

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


def _child_env() -> dict[str, str]:
    """The environment with this `hicache` package first on the path, so the server runs the same code as
    the benchmark even when the package is not installed (a source checkout)."""
    root = str(pathlib.Path(__file__).resolve().parents[2])  # the directory that holds hicache/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def check_serve_args(serve_args: Sequence[str]) -> None:
    for flag in ("--host", "--port"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in serve_args):
            raise UserError(f"{flag} is chosen by the benchmark; leave it out of the serve flags")


class ServerProcess:
    """One `python -m hicache serve SERVE_ARGS --host 127.0.0.1 --port P` (or another `command` that
    serves /health, such as `router`); a context manager."""

    def __init__(
        self,
        serve_args: Sequence[str],
        startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
        command: str = "serve",
    ) -> None:
        check_serve_args(serve_args)
        self.serve_args = list(serve_args)
        self.command = command
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("the server is already running")
        self.port = free_port(HOST)
        command = [sys.executable, "-m", "hicache", self.command, *self.serve_args]
        command += ["--host", HOST, "--port", str(self.port)]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server, closed in stop()
        started = time.perf_counter()
        # Its own session, so that a server that ignores SIGTERM can be killed with every process it spawned
        # (tensor-parallel ranks) and nothing else.
        self._proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=_child_env()
        )
        logger.info("started %s (pid %d)", " ".join(command), self._proc.pid)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        logger.info("server pid %d healthy at %s after %.1f s", self._proc.pid, self.url, time.perf_counter() - started)

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while time.monotonic() < deadline:
                code = self._proc.poll()
                if code is not None:
                    raise UserError(
                        f"`hicache {self.command} {' '.join(self.serve_args)}` exited with code {code} before it was "
                        f"healthy; its output ends with:\n{self.output_tail()}"
                    )
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.1)
        raise RuntimeError(
            f"`hicache {self.command} {' '.join(self.serve_args)}` not healthy after {self.startup_timeout_s:.0f} s; "
            f"its output ends with:\n{self.output_tail()}"
        )

    def output_tail(self, max_bytes: int = 4000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - max_bytes))
        return self._log.read().decode("utf-8", errors="replace")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "server pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, self.stop_timeout_s
                    )
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            elif proc.returncode:
                logger.warning(
                    "server pid %d had exited with code %d:\n%s", proc.pid, proc.returncode, self.output_tail()
                )
            logger.info("server pid %d stopped", proc.pid)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        """Stop, then start again with the same flags (on a new port): what a fresh process keeps is only
        what it finds in storage."""
        self.stop()
        self.start()

    def __enter__(self) -> ServerProcess:  # noqa: PYI034 - never subclassed
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
