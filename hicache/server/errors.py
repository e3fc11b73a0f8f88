"""Serving: every failure as an OpenAI-style error object `{"error": {message, type, param, code}}`.

Bad input (a `UserError` from the engine, a request that fails validation, invalid JSON, an unknown
route) is a 4xx with a message the client can act on; only a bug becomes a 500. The handlers return a
response and never re-raise, so one bad request cannot take the server down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hicache.errors import UserError, error_body

__all__ = ["APIError", "error_body", "error_response", "install_error_handlers"]

logger = logging.getLogger(__name__)

class APIError(Exception):
    """An error the server answers with directly (auth, unknown model, refused flush, shutting down)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


async def _client_gone(request: Request, _: ClientDisconnect) -> Response:
    """A client that closed its connection before its body arrived (a router that cancelled its copy of a
    request, a killed curl) made no request to answer: nothing ran, so there is nothing to report."""
    logger.info("client left while sending %s %s", request.method, request.url.path)
    return Response(status_code=499)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem as one line, and the top-level field it concerns (OpenAI's `param`)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{where}: {message}{more}", param


def install_error_handlers(app: FastAPI, on_rejected: Callable[[Request], None]) -> None:
    """`on_rejected` is told about every 4xx, for the requests counter."""

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status < 500:  # a 503 or 500 is an aborted or failed request, counted as such already
            on_rejected(request)
        return error_response(exc.status, exc.message, exc.code, exc.param)

    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        on_rejected(request)
        return error_response(exc.status, str(exc))

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_rejected(request)
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_value", param)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        on_rejected(request)
        return error_response(exc.status_code, str(exc.detail))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(UserError, user_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, _client_gone)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)
