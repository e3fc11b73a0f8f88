"""What the router has sent each server and not yet seen finish (docs/DESIGN.md, "router"): the load
the cache-aware policy weighs against a server's cache. Only this router's own requests count; it
never asks the servers."""

from __future__ import annotations

from hicache.router.scoring import Load


class Loads:
    def __init__(self) -> None:
        self._by_url: dict[str, Load] = {}

    def of(self, url: str) -> Load:
        return self._by_url.get(url, Load())

    def sent(self, url: str, tokens: int) -> None:
        load = self.of(url)
        self._by_url[url] = Load(load.requests + 1, load.tokens + tokens)

    def finished(self, url: str, tokens: int) -> None:
        load = self.of(url)
        self._by_url[url] = Load(load.requests - 1, load.tokens - tokens)
