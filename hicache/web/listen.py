"""The listening socket of a service, bound before anything slow starts, so a port in use or a bad
address is a one-line error at once rather than after the model has loaded."""

from __future__ import annotations

import socket

from hicache.errors import UserError

GRACEFUL_SHUTDOWN_S = 5.0  # backstop only: in-flight generations are aborted as the signal arrives


def listen(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
