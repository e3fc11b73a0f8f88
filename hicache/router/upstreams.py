"""P/D disaggregation: the router's view of its servers — who they are (each one's `/disagg/info`),
whether every prefill-decode pair may exchange KV (the start-up half of the handshake), and which pair
serves a request.

Start-up refuses, with one line naming the pair and the field, a server of the wrong role and any pair
whose rank-0 handshakes differ (model, dtype, page size, kernel mechanisms, an unverified
batch-invariance self-check), whose topologies are misaligned (a boundary that cuts a KV row,
hicache/disagg/cells.py), or whose served model names differ: such a pair could only fail every
request, or worse, change answers. Pairs of different TP or PP sizes are accepted.

Pairing is by prefix affinity, not round robin: the request's first message (or the head of its
prompt) picks the prefill and the decode server, so a conversation's turns, and conversations that
share a system prompt, keep meeting the trees that hold their history.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from hicache.disagg.cells import misaligned
from hicache.disagg.handshake import Handshake
from hicache.errors import UserError

AFFINITY_CHARS = 2048  # of a completion prompt's head that picks its pair


@dataclass(frozen=True)
class Upstream:
    url: str
    role: str
    served_model_name: str
    handshake: Handshake
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None


async def discover(client: httpx.AsyncClient, url: str, role: str, timeout_s: float) -> Upstream:
    """The server at `url`, once it answers /disagg/info (waiting up to `timeout_s` for it to start)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            response = await client.get(f"{url}/disagg/info", timeout=5.0)
            if response.status_code == 200:
                return _upstream(url, role, response.json())
            if response.status_code == 404:
                raise UserError(f"{url} is not a hicache server with a P/D role (no /disagg/info)")
            last = f"HTTP {response.status_code}"
        except (httpx.TransportError, json.JSONDecodeError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise UserError(f"the {role} server {url} did not answer within {timeout_s:.0f} s ({last})")
        await asyncio.sleep(0.2)


def _upstream(url: str, role: str, info: dict[str, Any]) -> Upstream:
    if info.get("role") != role:
        raise UserError(
            f"{url} is a server with --disaggregation-mode {info.get('role')}, but was given as a {role} server"
        )
    try:
        handshake = Handshake.from_json(info["handshake"])
    except (KeyError, ValueError) as exc:
        raise UserError(f"{url}: unreadable handshake ({exc})") from None
    return Upstream(
        url, role, str(info.get("served_model_name")), handshake, info.get("bootstrap_host"), info.get("bootstrap_port")
    )


def check_pairs(prefills: Sequence[Upstream], decodes: Sequence[Upstream]) -> None:
    """Raise UserError naming the first prefill-decode pair that may not exchange KV."""
    for p in prefills:
        for d in decodes:
            names = f"prefill {p.url}", f"decode {d.url}"
            refused = p.handshake.mismatch(d.handshake, *names) or misaligned(p.handshake, d.handshake, *names)
            if refused is None and p.served_model_name != d.served_model_name:
                refused = f"served model name differs: {p.served_model_name!r} and {d.served_model_name!r}"
            if refused is not None:
                raise UserError(f"cannot pair prefill {p.url} with decode {d.url}: {refused}")


def affinity_key(body: dict[str, Any]) -> bytes:
    """What picks a request's pair: its first chat message, or the head of its (first) prompt."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        return json.dumps(messages[0], sort_keys=True).encode()[:AFFINITY_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list):
        return json.dumps(prompt[: AFFINITY_CHARS // 4]).encode()
    return str(prompt)[:AFFINITY_CHARS].encode()


class Pairing:
    def __init__(self, prefills: Sequence[Upstream], decodes: Sequence[Upstream]) -> None:
        if not prefills or not decodes:
            raise UserError("a P/D router needs at least one --prefill and one --decode server")
        self.prefills = list(prefills)
        self.decodes = list(decodes)

    def pick(self, body: dict[str, Any]) -> tuple[Upstream, Upstream]:
        h = zlib.crc32(affinity_key(body))
        return self.prefills[h % len(self.prefills)], self.decodes[(h // len(self.prefills)) % len(self.decodes)]

    @property
    def servers(self) -> list[Upstream]:
        return self.prefills + self.decodes
