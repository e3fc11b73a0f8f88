"""Every failure as an OpenAI-style error object `{"error": {message, type, param, code}}`, and the
handlers both services install: an HTTP error (unknown route, wrong method) is a 4xx with its detail,
a client gone before its body arrived gets no answer, and only a bug becomes a 500. The handlers return
a response and never re-raise, so one bad request cannot take a service down."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hicache.errors import error_body

logger = logging.getLogger(__name__)


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def install_common_handlers(app: FastAPI, service: str, on_rejected: Callable[[Request], None]) -> None:
    """`service` names the service in its logs and 500s; `on_rejected` is told about every 4xx."""

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        on_rejected(request)
        return error_response(exc.status_code, str(exc.detail))

    async def client_gone(request: Request, _: ClientDisconnect) -> Response:
        """A client that closed its connection before its body arrived (a router that cancelled its copy
        of a request, a killed curl) made no request to answer: nothing ran, so there is nothing to report."""
        logger.info("%s: client left while sending %s %s", service, request.method, request.url.path)
        return Response(status_code=499)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s: unhandled error serving %s %s", service, request.method, request.url.path)
        return error_response(500, f"internal {service} error: {type(exc).__name__}")

    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, client_gone)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)
