"""Serving: the application factory. `create_app` wires one engine to an OpenAI-compatible HTTP API plus
the operational endpoints (/health, /flush_cache, /metrics, /debug/leaks).

The app owns no global state: its metrics registry, its request tracking and its engine handle live
in the objects built here, so tests can run several apps in one process. On shutdown (uvicorn's
lifespan) it aborts in-flight generations and stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hicache.engine.engine import Engine
from hicache.server.auth import BearerAuthMiddleware
from hicache.server.bridge import EngineClient
from hicache.server.errors import APIError, install_error_handlers
from hicache.server.metrics import ServerMetrics
from hicache.server.routes import GenerationRoutes

logger = logging.getLogger(__name__)


def create_app(engine: Engine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    metrics = ServerMetrics(engine)
    client = EngineClient(engine, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        client.abort_all()
        # shutdown() joins the scheduler thread, which still delivers its last events to this loop.
        await asyncio.to_thread(engine.shutdown)
        logger.info("engine stopped")

    app = FastAPI(title="hicache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # The tracker of live generations: `hicache serve` aborts them as soon as a shutdown signal arrives.
    app.state.engine_client = client

    def count_rejected(request: Request) -> None:
        if request.url.path.startswith("/v1/"):
            metrics.requests.labels(status="rejected").inc()

    install_error_handlers(app, count_rejected)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    app.include_router(GenerationRoutes(client, served_model_name).router())

    @app.get("/health")
    async def health() -> Response:
        if client.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return JSONResponse(
            {
                "status": "ok",
                "batch_invariance": engine.invariance,
                "weight_format": engine.weight_format,
                "weight_kernels": engine.weight_kernels,
                "dtype": engine.config.dtype,
                "kv_cache_dtype": engine.config.kv_cache_dtype,
            }
        )

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "hicache",
            "max_model_len": engine.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if client.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        # Blocks until the scheduler thread runs it between two steps: keep it off the event loop.
        if not await asyncio.to_thread(engine.flush_cache):
            raise APIError(
                409,
                "cannot flush the cache while requests are running or waiting; retry when idle",
                code="requests_running",
            )
        return JSONResponse({"message": "cache flushed"})

    @app.get("/disagg/info")
    async def disagg_info() -> Response:
        """This server's P/D role and handshake: what `hicache router` checks before pairing it; where
        its KV events are published and its page size, which a cache-aware router hashes prompts by."""
        info = await asyncio.to_thread(engine.disagg_info)
        events = {"kv_events_endpoint": engine.config.kv_events_endpoint, "page_size": engine.config.page_size}
        return JSONResponse({**info, **events, "served_model_name": served_model_name})

    @app.get("/hicache/storage_layout")
    async def storage_layout() -> Response:
        """The storage namespace and grid, so an external router can compute object keys."""
        return JSONResponse(engine.storage_layout())

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/debug/leaks")
    async def leaks() -> Response:
        """Pages not returned and nodes still locked; an empty list after a flush means no leak."""
        if client.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return JSONResponse(await asyncio.to_thread(engine.leak_report))

    return app
