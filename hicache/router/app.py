"""`hicache router`'s app: the OpenAI-compatible front of several servers. A policy (policies.py) picks,
for each generation request, a plain server, or a prefill and a decode server; the router answers with
that server's response (decode's, for a pair), streamed through as it comes.

A pair's two copies carry the same bootstrap host, port (the prefill server's transfer endpoint) and a
fresh random room; prefill's copy is never streamed and its answer only matters when it fails. Either half
failing ends the other: a prefill failure cancels the decode request (it would otherwise wait for KV
that is not coming) and the client gets prefill's error; the decode server's own failures (a transfer
that broke, a prefill that went away) come back as its response. A client that goes away cancels
every upstream request. Bad input gets an OpenAI-style 4xx (the servers validate the body; the router
only needs JSON with an object in it) and the router keeps serving. Each request counts as in flight
on the servers it was sent to (loads.py) until its response has ended.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hicache.errors import error_body
from hicache.router.loads import Loads
from hicache.router.policies import Policy, Routing
from hicache.router.upstreams import Fleet, Upstream
from hicache.web.disconnect import ClientGone, unless_disconnected
from hicache.web.errors import error_response, install_common_handlers

ROOM_BITS = 62  # rooms stay below the servers' limit with room for a batch's 64 prompts
FORWARDED_HEADERS = ("authorization",)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _upstream_error(message: str) -> JSONResponse:
    return error_response(502, message, "upstream_error")


def _sse_error(status: int, message: str, code: str) -> bytes:
    return f"data: {json.dumps(error_body(status, message, code))}\n\ndata: [DONE]\n\n".encode()


async def _failure(task: asyncio.Task[httpx.Response], server: Upstream) -> JSONResponse | None:
    """The error to answer with when prefill's half did not succeed (None when it did)."""
    try:
        response = task.result()
    except httpx.HTTPError as exc:
        return _upstream_error(f"the prefill server {server.url} failed: {type(exc).__name__}: {exc}")
    if response.status_code == 200:
        return None
    try:
        return JSONResponse(response.json(), status_code=response.status_code)
    except ValueError:
        return _upstream_error(f"the prefill server {server.url} answered HTTP {response.status_code}")


async def _discard(task: asyncio.Task[httpx.Response]) -> None:
    """Cancel a request still being sent, or close the response it already has (its server then
    sees the client gone and cancels the request)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        await task.result().aclose()


async def _until_done(chunks: AsyncIterator[bytes], done: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        done()


async def _passthrough(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()


class Router:
    def __init__(self, fleet: Fleet, policy: Policy, loads: Loads, client: httpx.AsyncClient) -> None:
        self.fleet = fleet
        self.policy = policy
        self.loads = loads
        self.client = client

    async def route(self, request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as exc:
            return error_response(400, f"the body is not valid JSON: {exc}", "invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", "invalid_value")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        routing = await self.policy.choose(body, self.fleet.groups, headers)
        done = self._in_flight(routing)
        try:
            if self.fleet.disaggregated:
                response = await self._pair(request, path, body, headers, routing.servers)
            else:
                response = await self._plain(request, path, body, headers, routing.servers[0])
        except BaseException:
            done()
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = _until_done(response.body_iterator, done)
        else:
            done()
        return response

    def _in_flight(self, routing: Routing) -> Callable[[], None]:
        """Count the request on its servers; the callable returned (idempotent) counts it finished."""
        for server in routing.servers:
            self.loads.sent(server.url, routing.prompt_tokens)
        finished = False

        def done() -> None:
            nonlocal finished
            if not finished:
                finished = True
                for server in routing.servers:
                    self.loads.finished(server.url, routing.prompt_tokens)

        return done

    async def _plain(
        self, request: Request, path: str, body: dict[str, Any], headers: dict[str, str], server: Upstream
    ) -> Response:
        upstream = self.client.build_request("POST", server.url + path, json=body, headers=headers)
        try:
            response = await unless_disconnected(request, self.client.send(upstream, stream=True))
        except ClientGone:
            return Response(status_code=499)
        except httpx.HTTPError as exc:
            return _upstream_error(f"the server {server.url} failed: {type(exc).__name__}: {exc}")
        if response.status_code != 200 or body.get("stream") is not True:
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            return Response(content, status_code=response.status_code, media_type="application/json")
        return StreamingResponse(_passthrough(response), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _pair(
        self, request: Request, path: str, body: dict[str, Any], headers: dict[str, str], pair: list[Upstream]
    ) -> Response:
        prefill, decode = pair
        boot = {
            "bootstrap_host": prefill.bootstrap_host,
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": secrets.randbits(ROOM_BITS),
        }
        prefill_body = {**body, **boot, "stream": False}
        prefill_body.pop("stream_options", None)
        prefill_task = asyncio.ensure_future(self.client.post(prefill.url + path, json=prefill_body, headers=headers))
        decode_request = self.client.build_request("POST", decode.url + path, json={**body, **boot}, headers=headers)
        streaming = body.get("stream") is True
        try:
            return await unless_disconnected(
                request, self._answer(prefill, prefill_task, decode, decode_request, streaming)
            )
        except ClientGone:
            prefill_task.cancel()
            return Response(status_code=499)

    async def _answer(
        self,
        prefill: Upstream,
        prefill_task: asyncio.Task[httpx.Response],
        decode: Upstream,
        decode_request: httpx.Request,
        streaming: bool,
    ) -> Response:
        decode_task = asyncio.ensure_future(self.client.send(decode_request, stream=True))
        try:
            done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and (failed := await _failure(prefill_task, prefill)) is not None:
                await _discard(decode_task)  # it would wait for KV that is not coming
                return failed
            response = await decode_task
        except httpx.HTTPError as exc:
            prefill_task.cancel()
            return _upstream_error(f"the decode server {decode.url} failed: {type(exc).__name__}: {exc}")
        except BaseException:  # cancelled: the client went away
            await _discard(decode_task)
            raise
        if response.status_code != 200 or not streaming:
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            if response.status_code != 200:
                prefill_task.cancel()  # decode refused it: prefill would wait for metadata that never comes
            return Response(content, status_code=response.status_code, media_type="application/json")
        return StreamingResponse(
            self._relay(response, prefill, prefill_task), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def _relay(
        self, response: httpx.Response, prefill: Upstream, prefill_task: asyncio.Task[httpx.Response]
    ) -> AsyncIterator[bytes]:
        """Decode's stream, byte for byte, unless prefill's half fails first."""
        chunks = response.aiter_raw().__aiter__()
        try:
            while True:
                nxt = asyncio.ensure_future(chunks.__anext__())
                watch: set[asyncio.Future[Any]] = {nxt} if prefill_task.done() else {nxt, prefill_task}
                done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    failed = await _failure(prefill_task, prefill)
                    if failed is not None:
                        nxt.cancel()
                        error = json.loads(bytes(failed.body)).get("error", {})
                        yield _sse_error(failed.status_code, str(error.get("message")), str(error.get("code")))
                        return
                try:
                    yield await nxt
                except StopAsyncIteration:
                    return
        finally:
            await response.aclose()
            if not prefill_task.done():
                prefill_task.cancel()


def create_router_app(fleet: Fleet, policy: Policy, loads: Loads, client: httpx.AsyncClient) -> FastAPI:
    router = Router(fleet, policy, loads, client)
    app = FastAPI(title="hicache router", docs_url=None, redoc_url=None, openapi_url=None)

    install_common_handlers(app, "router", lambda _: None)  # the servers count what they reject

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        server = fleet.groups[-1][0]  # the one that answers: a plain server, or a decode server
        try:
            response = await client.get(f"{server.url}/v1/models")
        except httpx.HTTPError as exc:
            return _upstream_error(f"the server {server.url} failed: {exc}")
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if fleet.disaggregated:
            servers = {"prefill": [s.url for s in fleet.prefills], "decode": [s.url for s in fleet.decodes]}
        else:
            servers = {"servers": [s.url for s in fleet.plain]}
        in_flight = {s.url: loads.of(s.url).requests for s in fleet.servers}
        return JSONResponse({"status": "ok", **servers, "in_flight": in_flight})

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """Flush every server's cache; the first refusal (409 while requests run) is the answer."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        for server in fleet.servers:
            try:
                response = await client.post(f"{server.url}/flush_cache", headers=headers)
            except httpx.HTTPError as exc:
                return _upstream_error(f"{server.url} failed: {exc}")
            if response.status_code != 200:
                return Response(response.content, status_code=response.status_code, media_type="application/json")
        return JSONResponse({"message": "cache flushed on every server"})

    return app
