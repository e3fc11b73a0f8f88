"""Serving: the `hicache serve` and `hicache router` commands — bind, load the engine (or check the
prefill-decode pairs), run the app under uvicorn, exit 0 on SIGTERM or SIGINT after a graceful shutdown.

The socket is bound before the (slow) engine load, so a taken port fails at once with one line. With
several ranks, a rank that dies (or ranks that diverge) fails the engine; the server then logs the
reason on one line and exits 1 instead of serving errors. Nodes other than node 0 (and torchrun ranks
other than 0) run their ranks only and serve nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

from hicache.config import EngineConfig
from hicache.config.flags import add_engine_args
from hicache.errors import UserError

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0  # backstop only: in-flight generations are aborted as the signal arrives


def _listen(host: str, port: int) -> socket.socket:
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


def _server_class():  # uvicorn is imported only by the command that needs it
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a shutdown signal first aborts the in-flight generations, so streams end
        now instead of the graceful shutdown waiting for each to reach its max_tokens."""

        def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
            super().__init__(config)
            self._on_exit = on_exit
            self._loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            if self._loop is not None:
                # A signal handler may interrupt the loop anywhere; run the abort as a loop callback.
                self._loop.call_soon_threadsafe(self._on_exit)

    return Server


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hicache.runtime.engine import Engine
    from hicache.runtime.launch import rank_only_node
    from hicache.server.app import create_app

    cfg = EngineConfig.from_args(args)
    ranks_only = rank_only_node(cfg)
    if ranks_only is not None:
        return ranks_only()
    sock = _listen(args.host, args.port)
    engine = Engine(cfg)
    name = args.served_model_name or args.model
    app = create_app(engine, name, api_key=args.api_key)
    config = uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _server_class()(config, on_exit=app.state.engine_client.abort_all)
    failures: list[str] = []

    def engine_failed(reason: str) -> None:
        failures.append(reason)
        server.should_exit = True  # uvicorn's loop checks this flag and shuts down gracefully

    engine.on_fatal(engine_failed)
    host, port = sock.getsockname()[:2]
    logger.info("serving %s on http://%s:%d", name, host, port)
    # uvicorn re-raises the shutdown signal once it is done, for the previous handler to act on; the
    # default SIGTERM action would then kill the process with the signal's status. The shutdown has
    # already been graceful by then, so the re-raised SIGTERM is ignored and the command exits 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failures:
        logger.error("exiting: %s", failures[0].splitlines()[0])
        return 1
    return 0


def _server_urls(urls: list[str], flag: str) -> list[str]:
    out = []
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{flag} must be an http:// URL, got {url!r}")
        out.append(url.rstrip("/"))
    return out


def run_router(args: argparse.Namespace) -> int:
    """`hicache router`: check every prefill-decode pair (hicache/disagg/upstreams.py), then serve."""
    import httpx
    import uvicorn

    from hicache.disagg.router import create_router_app
    from hicache.disagg.upstreams import Pairing, check_pairs, discover

    prefill_urls, decode_urls = _server_urls(args.prefill, "--prefill"), _server_urls(args.decode, "--decode")
    sock = _listen(args.host, args.port)

    async def find() -> Pairing:
        async with httpx.AsyncClient() as probe:
            prefills = [await discover(probe, url, "prefill", args.startup_timeout) for url in prefill_urls]
            decodes = [await discover(probe, url, "decode", args.startup_timeout) for url in decode_urls]
        check_pairs(prefills, decodes)
        return Pairing(prefills, decodes)

    pairing = asyncio.run(find())
    # No read timeout: a long generation is the client's to give up on (it disconnects; both halves cancel).
    timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=128))
    app = create_router_app(pairing, client)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    host, port = sock.getsockname()[:2]
    logger.info("routing on http://%s:%d: prefill %s, decode %s", host, port, prefill_urls, decode_urls)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as in run_serve: exit 0 after it
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def add_router_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "router", help="OpenAI-compatible front of a prefill-decode deployment (pairs a prefill and a decode server)"
    )
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a server started with --disaggregation-mode prefill (repeat for several)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a server started with --disaggregation-mode decode (repeat for several)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds to wait for every server to answer before giving up")
    p.set_defaults(func=run_router)


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics, /flush_cache)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*, /flush_cache and /debug/*"
    )
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model as given)")
    p.set_defaults(func=run_serve)
