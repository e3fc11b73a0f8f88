"""Fixtures for the server tests: real `hicache serve` subprocesses on loopback (end to end), and an
in-process app over a real tiny engine (fast, for the many small requests of the bad-input tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from hicache import Engine
from hicache.server.app import create_app
from tests.server.server_harness import ServerProcess, running_servers


@pytest.fixture(scope="session")
def server_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Two servers shared by the end-to-end tests: `cache` (radix cache on) and `nocache`."""
    log_dir = tmp_path_factory.mktemp("servers")
    with running_servers(log_dir, (), ("--disable-radix-cache",)) as (cache, nocache):
        yield {"cache": cache, "nocache": nocache}
    for server in (cache, nocache):
        assert "Traceback" not in server.log.read_text(), f"the server logged an error:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def servers(server_processes: dict[str, ServerProcess]) -> dict[str, str]:
    """Base URLs of the shared servers."""
    return {name: server.url for name, server in server_processes.items()}


@pytest.fixture(scope="session")
def server(servers: dict[str, str]) -> str:
    return servers["cache"]


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    """In-process app over a real tiny engine; short default outputs keep fuzzed valid requests fast.
    Leaving the `with` runs the app's lifespan shutdown, which stops the engine."""
    engine = Engine(model="tiny", default_max_new_tokens=8)
    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        yield client
