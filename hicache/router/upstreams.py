"""The router's view of its servers — who they are (each one's `/disagg/info`: role, handshake, served
model, page size, where it publishes its KV events), whether every prefill-decode pair may exchange KV
(the start-up half of the handshake), and the groups a request picks one server from (policies.py).

Start-up refuses, with one line naming the pair and the field, a server of the wrong role and any pair
whose rank-0 handshakes differ (model, dtype, page size, kernel mechanisms, an unverified
batch-invariance self-check), whose topologies are misaligned (a boundary that cuts a KV row,
hicache/disagg/cells.py), or whose served model names differ: such a pair could only fail every
request, or worse, change answers. Pairs of different TP or PP sizes are accepted. Plain servers (no
P/D role) must share a served model name: a request names one.

A server's events endpoint comes from the server itself, so it can never be attached to the wrong
server; a wildcard bind address (tcp://0.0.0.0:port) is reached at the server URL's host, and
`--kv-events URL=ENDPOINT` overrides it where the router reaches the server another way (a port
mapping, a NAT). A plain server of another engine (a vLLM server: no /disagg/info) is accepted by its
served model name, its events at the `--kv-events` endpoint given for it (vLLM's format, hicache's too).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from hicache.disagg.cells import misaligned
from hicache.disagg.handshake import Handshake
from hicache.errors import UserError

WILDCARD_HOSTS = ("0.0.0.0", "*", "::")
PLAIN = "null"  # the role /disagg/info names for a server that does everything itself


@dataclass(frozen=True)
class Upstream:
    url: str
    role: str
    served_model_name: str
    handshake: Handshake | None  # None: a plain server
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    kv_events_endpoint: str | None = None  # where the router subscribes to its KV events; None: it publishes none
    page_size: int | None = 16  # None: not told (another engine's server): its events' block size


async def discover(
    client: httpx.AsyncClient, url: str, role: str, timeout_s: float, kv_events: str | None = None
) -> Upstream:
    """The server at `url`, once it answers /disagg/info (waiting up to `timeout_s` for it to start);
    `kv_events`: where to subscribe to its events instead of where it says it publishes them."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            response = await client.get(f"{url}/disagg/info", timeout=5.0)
            if response.status_code == 200:
                return _upstream(url, role, response.json(), kv_events)
            if response.status_code == 404:
                return await _other_server(client, url, role, kv_events)
            last = f"HTTP {response.status_code}"
        except (httpx.TransportError, json.JSONDecodeError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise UserError(f"the {role} server {url} did not answer within {timeout_s:.0f} s ({last})")
        await asyncio.sleep(0.2)


async def _other_server(client: httpx.AsyncClient, url: str, role: str, kv_events: str | None) -> Upstream:
    """A server of another engine (vLLM, SGLang: no /disagg/info): a plain one, named by its first served
    model (`GET /v1/models`), its KV events where `--kv-events` says (vLLM's format), its page size
    theirs. It can take no part in a P/D pair: nothing says its KV layout."""
    if role != PLAIN:
        raise UserError(f"{url} is not a hicache server (no /disagg/info): it cannot be a {role} server")
    try:
        response = await client.get(f"{url}/v1/models", timeout=5.0)
        name = response.json()["data"][0]["id"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise UserError(f"{url} answers neither /disagg/info nor /v1/models ({type(exc).__name__})") from None
    return Upstream(url, PLAIN, str(name), None, kv_events_endpoint=kv_events, page_size=None)


def reachable_endpoint(endpoint: str | None, url: str) -> str | None:
    """Where the router reaches a server's events: a wildcard bind host is the server URL's host."""
    if endpoint is None:
        return None
    parts = urlsplit(endpoint)
    if parts.hostname in WILDCARD_HOSTS:
        return f"{parts.scheme}://{urlsplit(url).hostname}:{parts.port}"
    return endpoint


def _upstream(url: str, role: str, info: dict[str, Any], kv_events: str | None) -> Upstream:
    if info.get("role") != role:
        given = "a plain server" if role == PLAIN else f"a {role} server"
        raise UserError(f"{url} is a server with --disaggregation-mode {info.get('role')}, but was given as {given}")
    handshake = None
    if role != PLAIN:
        try:
            handshake = Handshake.from_json(info["handshake"])
        except (KeyError, ValueError) as exc:
            raise UserError(f"{url}: unreadable handshake ({exc})") from None
    endpoint = kv_events or reachable_endpoint(info.get("kv_events_endpoint"), url)
    return Upstream(url, role, str(info.get("served_model_name")), handshake, info.get("bootstrap_host"),
                    info.get("bootstrap_port"), endpoint, int(info.get("page_size", 16)))  # fmt: skip


def check_pairs(prefills: Sequence[Upstream], decodes: Sequence[Upstream]) -> None:
    """Raise UserError naming the first prefill-decode pair that may not exchange KV."""
    for p in prefills:
        for d in decodes:
            assert p.handshake is not None and d.handshake is not None  # _upstream reads it for every P/D role
            names = f"prefill {p.url}", f"decode {d.url}"
            refused = p.handshake.mismatch(d.handshake, *names) or misaligned(p.handshake, d.handshake, *names)
            if refused is None and p.served_model_name != d.served_model_name:
                refused = f"served model name differs: {p.served_model_name!r} and {d.served_model_name!r}"
            if refused is not None:
                raise UserError(f"cannot pair prefill {p.url} with decode {d.url}: {refused}")


def check_plain(servers: Sequence[Upstream]) -> None:
    """Raise UserError naming the first plain server whose served model name differs from the first's."""
    for server in servers[1:]:
        if server.served_model_name != servers[0].served_model_name:
            raise UserError(
                f"cannot route to both {servers[0].url} and {server.url}: served model name differs: "
                f"{servers[0].served_model_name!r} and {server.served_model_name!r}"
            )


class Fleet:
    """The servers behind a router: prefill-decode pairs, or plain servers that do everything."""

    def __init__(
        self, prefills: Sequence[Upstream] = (), decodes: Sequence[Upstream] = (), plain: Sequence[Upstream] = ()
    ) -> None:
        self.check_shape(prefills, decodes, plain)
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self.plain = list(plain)

    @staticmethod
    def check_shape(prefills: Sequence[object], decodes: Sequence[object], plain: Sequence[object]) -> None:
        """Raise UserError unless these are plain servers, or prefill and decode servers, not both."""
        if plain and (prefills or decodes):
            raise UserError("a router serves either plain servers (--server) or P/D pairs (--prefill, --decode)")
        if not plain and (not prefills or not decodes):
            raise UserError("a router needs --server URL, or at least one --prefill and one --decode server")

    @property
    def disaggregated(self) -> bool:
        return not self.plain

    @property
    def groups(self) -> list[list[Upstream]]:
        """What a request picks one server from each of: [prefills, decodes], or [plain servers]."""
        return [self.prefills, self.decodes] if self.disaggregated else [self.plain]

    @property
    def servers(self) -> list[Upstream]:
        return self.prefills + self.decodes + self.plain
