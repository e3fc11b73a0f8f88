"""Serving: optional Bearer-token authentication (`--api-key`).

A pure ASGI middleware rather than a route dependency, so a wrong key is refused before the body is
read or validated (a 401, never a 400 that would tell an unauthenticated client about the API), and
streaming responses pass through untouched. /health and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from hicache.web.errors import error_response

PROTECTED_PREFIXES = ("/v1/", "/flush_cache", "/debug/")


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return secrets.compare_digest(value, self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and not self._authorized(scope):
            response = error_response(
                401, "missing or invalid API key (send `Authorization: Bearer <key>`)", code="invalid_api_key"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
