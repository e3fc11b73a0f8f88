"""SIGTERM with streams in flight: the in-flight requests are aborted, uvicorn shuts down gracefully,
the engine stops, and the process exits 0 within a few seconds."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.server.server_harness import running_servers

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

STREAMS = 4


def test_sigterm_with_streams_in_flight(tmp_path) -> None:
    with running_servers(tmp_path, ()) as (server,):
        started = threading.Barrier(STREAMS + 1, timeout=30)
        endings: list[list[str]] = []

        def stream(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": f"Stream {i} for a long time",
                "max_tokens": 4000,
                "stream": True,
                "ignore_eos": True,
            }
            try:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
                    lines = r.iter_lines()
                    next(lines)
                    started.wait()
                    endings.append([line for line in lines if line][-2:])
            except httpx.HTTPError as exc:  # should not happen: each stream is ended, then closed
                endings.append([repr(exc)])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait()
        began = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        try:
            code = server.proc.wait(timeout=15)
        except Exception:
            pytest.fail(f"server did not exit after SIGTERM:\n{server.log_tail()}")
        elapsed = time.monotonic() - began
        for t in threads:
            t.join(timeout=10)
        assert code == 0, server.log_tail()
        assert elapsed < 5, f"took {elapsed:.1f}s to exit"
        assert len(endings) == STREAMS
        for error, done in endings:
            # Each stream was told why it ended, then ended properly.
            assert "the server is shutting down" in error and done == "data: [DONE]"
        assert "Traceback" not in server.log_tail()
