"""`hicache router`: the OpenAI-compatible front of a prefill-decode deployment. It checks every
prefill-decode pair before it listens (upstreams.py), then serves (app.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from hicache.errors import UserError
from hicache.web.listen import GRACEFUL_SHUTDOWN_S, listen

logger = logging.getLogger(__name__)


def _server_urls(urls: list[str], flag: str) -> list[str]:
    out = []
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{flag} must be an http:// URL, got {url!r}")
        out.append(url.rstrip("/"))
    return out


def run_router(args: argparse.Namespace) -> int:
    """`hicache router`: check every prefill-decode pair (upstreams.py), then serve."""
    import httpx
    import uvicorn

    from hicache.router.app import create_router_app
    from hicache.router.upstreams import Pairing, check_pairs, discover

    prefill_urls, decode_urls = _server_urls(args.prefill, "--prefill"), _server_urls(args.decode, "--decode")
    sock = listen(args.host, args.port)

    async def find() -> Pairing:
        async with httpx.AsyncClient() as probe:
            prefills = [await discover(probe, url, "prefill", args.startup_timeout) for url in prefill_urls]
            decodes = [await discover(probe, url, "decode", args.startup_timeout) for url in decode_urls]
        check_pairs(prefills, decodes)
        return Pairing(prefills, decodes)

    pairing = asyncio.run(find())
    # No read timeout: a long generation is the client's to give up on (it disconnects; both halves cancel).
    timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
    client = httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=128)
    )
    app = create_router_app(pairing, client)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    host, port = sock.getsockname()[:2]
    logger.info("routing on http://%s:%d: prefill %s, decode %s", host, port, prefill_urls, decode_urls)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as `hicache serve`: exit 0 after it
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def add_router_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "router", help="OpenAI-compatible front of a prefill-decode deployment (pairs a prefill and a decode server)"
    )
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a server started with --disaggregation-mode prefill (repeat for several)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a server started with --disaggregation-mode decode (repeat for several)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for every server to answer before giving up",
    )
    p.set_defaults(func=run_router)
