"""Starts and stops a prefill-decode deployment for one benchmark arm (`--launch-pd`; the `bench` part
of the design): a `hicache serve --disaggregation-mode prefill` server, a `--disaggregation-mode
decode` server, and a `hicache router` in front of them, each on a free 127.0.0.1 port, stopped by pid.
The benchmark talks to the router only; at the end of the arm it reads the KV bytes decode received
from decode's /metrics (`hicache_disagg_received_bytes_total`), which no client can see.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hicache.bench.launcher import HOST, ServerProcess
from hicache.engine.launch import free_port

logger = logging.getLogger(__name__)

RECEIVED_BYTES = "hicache_disagg_received_bytes_total"


class PDDeployment:
    """The same interface as ServerProcess for a runner: start, stop, url."""

    def __init__(self, prefill_args: Sequence[str], decode_args: Sequence[str]) -> None:
        self.bootstrap_port = 0
        self.prefill_args, self.decode_args = list(prefill_args), list(decode_args)
        self.prefill: ServerProcess | None = None
        self.decode: ServerProcess | None = None
        self.router: ServerProcess | None = None

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def start(self) -> None:
        self.bootstrap_port = free_port(HOST)
        boot = ["--disaggregation-bootstrap-host", HOST, "--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        self.prefill = ServerProcess([*self.prefill_args, "--disaggregation-mode", "prefill", *boot])
        self.decode = ServerProcess([*self.decode_args, "--disaggregation-mode", "decode"])
        try:
            self.prefill.start()
            self.decode.start()
            self.router = ServerProcess(["--prefill", self.prefill.url, "--decode", self.decode.url], command="router")
            self.router.start()
        except BaseException:
            self.stop()
            raise

    def received_bytes(self) -> int | None:
        """KV bytes decode has received so far (None if its /metrics does not say)."""
        if self.decode is None:
            return None
        try:
            text = httpx.get(f"{self.decode.url}/metrics", timeout=10).text
        except httpx.HTTPError as exc:
            logger.warning("cannot read decode's /metrics: %s", exc)
            return None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == RECEIVED_BYTES:
                    return int(sample.value)
        return None

    def stop(self) -> None:
        for server in (self.router, self.decode, self.prefill):
            if server is not None:
                server.stop()
        self.router = self.decode = self.prefill = None
