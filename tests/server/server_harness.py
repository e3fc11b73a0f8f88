"""Harness for the server tests: `hicache serve` subprocesses on loopback (started and stopped by pid),
and helpers to read /metrics and check for leaks."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hicache.engine.launch import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
STARTUP_DEADLINE_S = 60.0


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, url: str, log: pathlib.Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"server not healthy after {STARTUP_DEADLINE_S}s:\n{self.log_tail()}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def wait_stopped(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        self.terminate()
        self.wait_stopped()


def spawn_server(log_dir: pathlib.Path, *args: str) -> ServerProcess:
    """Start `hicache serve --model tiny` on a free loopback port; the caller stops it (by pid)."""
    port = free_port()
    log = log_dir / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "hicache",
        "--log-level",
        "info",
        "serve",
        "--model",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log)


@contextlib.contextmanager
def running_servers(log_dir: pathlib.Path, *arg_lists: tuple[str, ...]) -> Iterator[list[ServerProcess]]:
    """Start several servers at once (their start-ups overlap) and stop them all at the end."""
    servers = [spawn_server(log_dir, *args) for args in arg_lists]
    try:
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:  # signal all first: their exits overlap too
            server.terminate()
        for server in servers:
            server.wait_stopped()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def assert_no_leaks(url: str) -> None:
    """Flush, then the engine's leak report is empty and the device pool holds nothing."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.post(f"{url}/flush_cache", timeout=10)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # a cancelled request may still be leaving the batch
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/debug/leaks", timeout=10).json() == []
    assert metric(scrape(url), "hicache_pool_used_tokens", tier="device") == 0
