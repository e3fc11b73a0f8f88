"""Errors a user can cause and fix. The CLI turns them into one line and exit code 2; the server into an
HTTP 4xx with an OpenAI-style error object. Anything else is a bug and surfaces as such."""


class UserError(ValueError):
    """Bad input: an unknown model, a missing file, an invalid flag or request. `status` is the HTTP code."""

    status = 400


class NotFoundError(UserError):
    status = 404


class RequestTooLargeError(UserError):
    """A prompt (plus its output budget) that can never fit the context or the KV pool."""

    status = 400
