"""Serving: every failure as an OpenAI-style error object `{"error": {message, type, param, code}}`.

Bad input (a `UserError` from the engine, a request that fails validation, invalid JSON, an unknown
route) is a 4xx with a message the client can act on; only a bug becomes a 500. The handlers return a
response and never re-raise, so one bad request cannot take the server down.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from hicache.errors import UserError
from hicache.web.errors import error_response, install_common_handlers


class APIError(Exception):
    """An error the server answers with directly (auth, unknown model, refused flush, shutting down)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


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

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(UserError, user_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    install_common_handlers(app, "server", on_rejected)
