"""`hicache router`: the OpenAI-compatible front of several servers, plain or prefill-decode pairs. It
finds every server and checks every prefill-decode pair before it listens (upstreams.py), subscribes to
their KV events for the cache-aware policy (cache_view.py), then serves (app.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from hicache.errors import UserError
from hicache.web.listen import GRACEFUL_SHUTDOWN_S, listen

logger = logging.getLogger(__name__)


def _server_urls(urls: list[str] | None, flag: str) -> list[str]:
    out = []
    for url in urls or []:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{flag} must be an http:// URL, got {url!r}")
        out.append(url.rstrip("/"))
    return out


def _event_overrides(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        url, sep, endpoint = pair.partition("=")
        if not sep or not endpoint.startswith("tcp://"):
            raise UserError(f"--kv-events must be URL=tcp://host:port, got {pair!r}")
        out[_server_urls([url], "--kv-events")[0]] = endpoint
    return out


def run_router(args: argparse.Namespace) -> int:
    """`hicache router`: find and check every server (upstreams.py), then serve."""
    import httpx
    import uvicorn

    from hicache.router.app import create_router_app
    from hicache.router.cache_view import CacheView
    from hicache.router.loads import Loads
    from hicache.router.policies import make_policy
    from hicache.router.upstreams import PLAIN, Fleet, check_pairs, check_plain, discover

    prefill_urls, decode_urls = _server_urls(args.prefill, "--prefill"), _server_urls(args.decode, "--decode")
    plain_urls = _server_urls(args.server, "--server")
    events = _event_overrides(args.kv_events)
    if unknown := set(events) - set(prefill_urls + decode_urls + plain_urls):
        raise UserError(f"--kv-events names a server not given to the router: {sorted(unknown)[0]}")
    Fleet.check_shape(prefill_urls, decode_urls, plain_urls)  # before waiting for any server
    sock = listen(args.host, args.port)

    async def find() -> Fleet:
        async with httpx.AsyncClient() as probe:
            found = {
                role: [await discover(probe, url, role, args.startup_timeout, events.get(url)) for url in urls]
                for role, urls in (("prefill", prefill_urls), ("decode", decode_urls), (PLAIN, plain_urls))
            }
        check_pairs(found["prefill"], found["decode"])
        check_plain(found[PLAIN])
        return Fleet(found["prefill"], found["decode"], found[PLAIN])

    fleet = asyncio.run(find())
    # No read timeout: a long generation is the client's to give up on (it disconnects; both halves cancel).
    timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
    client = httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=128)
    )
    view = CacheView(fleet.servers) if args.policy == "cache-aware" else None
    loads = Loads()
    app = create_router_app(fleet, make_policy(args.policy, view, loads, client), loads, client)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    host, port = sock.getsockname()[:2]
    logger.info("routing on http://%s:%d (%s): %s", host, port, args.policy, [s.url for s in fleet.servers])
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as `hicache serve`: exit 0 after it
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        if view is not None:
            view.close()
    return 0


def add_router_command(sub: argparse._SubParsersAction) -> None:
    from hicache.router.policies import POLICIES

    p = sub.add_parser(
        "router", help="OpenAI-compatible front of several servers: plain (--server) or prefill-decode pairs"
    )
    p.add_argument("--server", action="append", metavar="URL", help="a plain server (repeat for several)")
    p.add_argument(
        "--prefill",
        action="append",
        metavar="URL",
        help="a server started with --disaggregation-mode prefill (repeat for several)",
    )
    p.add_argument(
        "--decode",
        action="append",
        metavar="URL",
        help="a server started with --disaggregation-mode decode (repeat for several)",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="first-message",
        help="which server serves a request: hash of its first message (default), in turn, or by the servers' "
        "KV events (cache-aware: each server's cached prefix of the prompt, by tier, against its load)",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        metavar="URL=ENDPOINT",
        help="cache-aware: subscribe to the server at URL's KV events at ENDPOINT (tcp://host:port) instead of "
        "where the server says it publishes them (its --kv-events-endpoint)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for every server to answer before giving up",
    )
    p.set_defaults(func=run_router)
