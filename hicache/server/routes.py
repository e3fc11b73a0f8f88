"""Serving: the OpenAI generation endpoints, /v1/completions and /v1/chat/completions, whole or streamed
as server-sent events.

Every prompt is submitted before a response starts, so a bad one gets a plain 4xx error object even on
a streaming request. A stream that ends early (client gone, server shutting down) closes its
`Generation`, which cancels the engine requests and frees their pages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

import jinja2
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from hicache.errors import UserError, error_body
from hicache.scheduler.request import FinishReason, SamplingParams
from hicache.server.bridge import Choice, EngineClient, Generation
from hicache.server.errors import APIError
from hicache.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from hicache.server.responses import ChatFormat, CompletionFormat, ResponseFormat, usage
from hicache.server.streaming import IncrementalDetokenizer
from hicache.web.disconnect import ClientGone, unless_disconnected

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=GenerationRequest)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def _json(request: Request) -> object:
    """The body as JSON whatever its Content-Type (curl's -d sends a form type)."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, an int too long, nesting too deep
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


async def _parse(request: Request, model: type[R], data: object = None) -> R:
    """The body (or `data`, the body already read) validated as `model`."""
    if data is None:
        data = await _json(request)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False), body=data) from None


def _failure(client: EngineClient, choice: Choice) -> APIError:
    """The error for a choice that ended without completing (aborted or failed in the engine)."""
    if choice.finish_reason is FinishReason.ERROR:
        return APIError(500, choice.error or "the engine failed this request", code="engine_error")
    if choice.finish_reason is FinishReason.TIMEOUT:
        return APIError(504, choice.error or "the request timed out", code="timeout")
    reason = "the server is shutting down" if client.draining else "the request was aborted"
    return APIError(503, reason, code="aborted")


class GenerationRoutes:
    def __init__(self, client: EngineClient, served_model_name: str) -> None:
        self.client = client
        self.engine = client.engine
        self.model = served_model_name

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], response_model=None)
        router.add_api_route("/tokenize", self.tokenize, methods=["POST"], response_model=None)
        return router

    def _check_model(self, body: GenerationRequest) -> None:
        if body.model != self.model:
            raise APIError(
                404,
                f"the model `{body.model}` does not exist; this server serves `{self.model}`",
                code="model_not_found",
                param="model",
            )

    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        self._check_model(body)
        fmt = CompletionFormat(self.model, self.engine.tokenizer, body.include_usage)
        return await self._generate(request, body, body.prompts(), body.to_sampling_params(), fmt)

    async def chat_completions(self, request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body)
        fmt = ChatFormat(self.model, self.engine.tokenizer, body.include_usage)
        return await self._generate(request, body, [self._chat_prompt(body)], body.to_sampling_params(), fmt)

    async def tokenize(self, request: Request) -> Response:
        """The token ids a completion or chat body's (first) prompt becomes on this server, chat template
        included: what `hicache router --policy cache-aware` hashes into page hashes to find the server
        holding its prefix (docs/DESIGN.md, "router")."""
        data = await _json(request)
        chat = isinstance(data, dict) and "messages" in data
        body = await _parse(request, ChatCompletionRequest if chat else CompletionRequest, data)
        self._check_model(body)
        prompt = self._chat_prompt(body) if isinstance(body, ChatCompletionRequest) else body.prompts()[0]
        ids = self.engine.tokenize(prompt)
        return JSONResponse({"tokens": ids, "count": len(ids)})

    def _chat_prompt(self, body: ChatCompletionRequest) -> str:
        try:
            return self.engine.tokenizer.chat_template.render(body.template_messages())
        except jinja2.TemplateError as exc:
            raise UserError(f"the chat template refused these messages: {exc}") from None

    async def _generate(
        self, request: Request, body: GenerationRequest, prompts: list, params: SamplingParams, fmt: ResponseFormat
    ) -> Response:
        gen = self.client.start(
            prompts, params, body.cache_salt, body.bootstrap(), priority=body.priority,
            retention_seconds=body.retention_seconds,
        )  # fmt: skip
        if body.stream:
            stream = self._stream(gen, fmt, params.stop, body.include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            choices = await unless_disconnected(request, gen.wait())
        except ClientGone:
            # Nobody will read the answer; closing the generation below cancels the work.
            return Response(status_code=499)
        finally:
            gen.close()
        for choice in choices:
            if choice.finish_reason not in COMPLETED:
                raise _failure(self.client, choice)
        texts = [self.engine.detokenize(c.token_ids, c.matched_stop) for c in choices]
        return JSONResponse(fmt.response(choices, texts))

    async def _stream(
        self, gen: Generation, fmt: ResponseFormat, stop: tuple[str, ...], include_usage: bool
    ) -> AsyncIterator[str]:
        decode = self.engine.tokenizer.decode
        detoks = [IncrementalDetokenizer(decode, self.engine.detokenize, stop) for _ in gen.choices]
        try:
            for chunk in fmt.opening_chunks(len(gen.choices)):
                yield _sse(chunk)
            async for index, event in gen.events():
                if event.finish_reason is None:
                    text = detoks[index].push(event.new_token_ids)
                elif event.finish_reason in COMPLETED:
                    text = detoks[index].finish(event.new_token_ids, event.matched_stop)
                else:
                    err = _failure(self.client, gen.choices[index])
                    yield _sse(error_body(err.status, err.message, err.code))
                    break
                if text or event.logprobs:
                    yield _sse(fmt.delta_chunk(index, text, event.logprobs))
                if event.finish_reason is not None:
                    yield _sse(fmt.finish_chunk(index, event.finish_reason.value))
            else:
                if include_usage:
                    yield _sse(fmt.usage_chunk(usage(gen.choices)))
            yield _sse("[DONE]")
        finally:
            # Runs on normal end, on a client disconnect (the task is cancelled) and on shutdown.
            gen.close()
