"""Errors a user can cause and fix. The CLI turns them into one line and exit code 2; the server into an
HTTP 4xx with an OpenAI-style error object. Anything else is a bug and surfaces as such."""

import json


class UserError(ValueError):
    """Bad input: an unknown model, a missing file, an invalid flag or request. `status` is the HTTP code."""

    status = 400


class RequestTooLargeError(UserError):
    """A prompt (plus its output budget) that can never fit the context or the KV pool."""

    status = 400


_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error", 503: "service_unavailable"}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """An OpenAI-style error object, the one shape of every HTTP error (the server's and the router's)."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_object(text: str, flag: str) -> dict:
    """A flag's value that must be a JSON object, parsed; UserError naming `flag` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag} must be a JSON object, got {text}")
    return value
