"""`hicache serve` user errors: one line and exit code 2, before the engine is loaded."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.server.server_harness import REPO

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


def test_unusable_port_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Both in one process start: an interpreter with torch takes seconds to come up here.
        script = (
            "import sys; from hicache.cli import main; "
            f"sys.exit(10 * main(['serve', '--port', '{port}']) + main(['serve', '--port', '70000']))"
        )
        result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 22, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"hicache: error: cannot listen on 127.0.0.1:{port}: ")
    assert lines[1] == "hicache: error: --port must be between 0 and 65535, got 70000"
