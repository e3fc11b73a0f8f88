"""`hicache router --policy`: which server of each group (upstreams.Fleet.groups: the plain servers, or
the prefill and the decode servers) serves a request (docs/DESIGN.md, "router").

- `first-message` (the default): the request's first chat message, or the head of its prompt, hashed,
  so a conversation's turns, and conversations that share a system prompt, keep meeting the same
  servers. Needs nothing from the servers; blind to everything after the first message.
- `round-robin`: each request to the next server, blind to caches.
- `cache-aware`: the servers' KV events (cache_view.py) say which leading pages of the prompt each one
  holds, on which tier; each group's server with the least prefill left to do plus load wins
  (scoring.py), so a conversation follows its history and a prompt nobody holds goes to the least
  loaded. A P/D request picks its prefill and its decode server each by its own cache.

Whatever a policy picks, the answer is the same (the server matches the prompt against its own tree);
a policy only decides how much of the prompt is computed again.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from hicache.events import prompt_hashes
from hicache.router.cache_view import CacheView
from hicache.router.loads import Loads
from hicache.router.prompt_tokens import prompt_ids
from hicache.router.scoring import cheapest, cost, saved_tokens
from hicache.router.upstreams import Upstream

AFFINITY_CHARS = 2048  # of a completion prompt's head that picks its servers
POLICIES = ("first-message", "round-robin", "cache-aware")


@dataclass(frozen=True)
class Routing:
    servers: list[Upstream]  # one per group
    prompt_tokens: int = 0  # as far as the policy knows them (the load they add); 0 when it did not look


class Policy(Protocol):
    async def choose(
        self, body: dict[str, Any], groups: Sequence[Sequence[Upstream]], headers: dict[str, str]
    ) -> Routing: ...


def affinity_key(body: dict[str, Any]) -> bytes:
    """What picks a request's servers under first-message: its first chat message, or the head of its
    (first) prompt."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        return json.dumps(messages[0], sort_keys=True).encode()[:AFFINITY_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list):
        return json.dumps(prompt[: AFFINITY_CHARS // 4]).encode()
    return str(prompt)[:AFFINITY_CHARS].encode()


class FirstMessage:
    async def choose(
        self, body: dict[str, Any], groups: Sequence[Sequence[Upstream]], headers: dict[str, str]
    ) -> Routing:
        h = zlib.crc32(affinity_key(body))
        picks = []
        for group in groups:
            picks.append(group[h % len(group)])
            h //= len(group)  # the next group's pick from the hash's other digits: every pair is reached
        return Routing(picks)


class RoundRobin:
    def __init__(self) -> None:
        self.turn = 0

    async def choose(
        self, body: dict[str, Any], groups: Sequence[Sequence[Upstream]], headers: dict[str, str]
    ) -> Routing:
        self.turn += 1
        return Routing([group[self.turn % len(group)] for group in groups])


class CacheAware:
    def __init__(self, view: CacheView, loads: Loads, client: httpx.AsyncClient) -> None:
        self.view = view
        self.loads = loads
        self.client = client
        self.picked = 0  # requests routed
        self.last_picked: dict[str, int] = {}  # by server: the number of the request it last got

    async def choose(
        self, body: dict[str, Any], groups: Sequence[Sequence[Upstream]], headers: dict[str, str]
    ) -> Routing:
        servers = [server for group in groups for server in group]
        tokenizer = min(servers, key=lambda s: self.loads.of(s.url).requests)
        ids = await prompt_ids(self.client, tokenizer.url, body, headers) or []
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else ""
        chains: dict[int, list[bytes]] = {}  # by page size: servers of one fleet normally share one
        picks = []
        for group in groups:
            costs = []
            for server in group:
                tiers, page_size = [], self.view.page_size(server)
                if page_size is not None:  # None: another engine's server whose events said nothing yet
                    if page_size not in chains:
                        chains[page_size] = prompt_hashes(ids, page_size, salt)
                    tiers = self.view.prefix_tiers(server, chains[page_size])
                costs.append(cost(len(ids), saved_tokens(tiers, page_size or 0), self.loads.of(server.url)))
            last = [self.last_picked.get(s.url, -1) for s in group]
            pick = group[cheapest(costs, [self.loads.of(s.url) for s in group], last)]
            self.last_picked[pick.url] = self.picked
            picks.append(pick)
        self.picked += 1
        return Routing(picks, len(ids))


def make_policy(name: str, view: CacheView | None, loads: Loads, client: httpx.AsyncClient) -> Policy:
    if name == "cache-aware":
        assert view is not None, "the cache-aware policy reads the servers' KV events"
        return CacheAware(view, loads, client)
    return RoundRobin() if name == "round-robin" else FirstMessage()
