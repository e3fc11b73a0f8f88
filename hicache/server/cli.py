"""Serving: the `hicache serve` command — bind, load the engine, run the app under uvicorn, exit 0 on
SIGTERM or SIGINT after a graceful shutdown (`hicache router` is hicache/router/cli.py).

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
from hicache.web.listen import GRACEFUL_SHUTDOWN_S, listen

logger = logging.getLogger(__name__)


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

    from hicache.engine.engine import Engine
    from hicache.engine.launch import rank_only_node
    from hicache.server.app import create_app

    cfg = EngineConfig.from_args(args)
    ranks_only = rank_only_node(cfg)
    if ranks_only is not None:
        return ranks_only()
    sock = listen(args.host, args.port)
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
    logger.info("serving %s on http://%s:%d (%s activations, %s KV cache, weights %s on %s kernels)", name, host,
                port, engine.config.dtype, engine.config.kv_cache_dtype, engine.weight_format,
                engine.weight_kernels)  # fmt: skip
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


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics, /flush_cache)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=30000, help="HTTP port")
    g.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*, /flush_cache and /debug/*"
    )
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model as given)")
    p.set_defaults(func=run_serve)
