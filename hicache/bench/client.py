"""The benchmark's HTTP client (the `bench` part of the design): one streaming request to any
OpenAI-compatible server, timed on the raw SSE stream.

TTFT is the time from sending the request to the first chunk that carries text; ITL the gaps between
later text chunks (a chunk may hold more than one token). Usage comes from the final chunk that
`stream_options.include_usage` asks for. The non-standard fields read are `cached_tokens_by_tier`
(hicache's per-tier split of `prompt_tokens_details.cached_tokens`; servers without it are reported
with tiers unknown) and, through `hicache router`, `transferred_tokens` (the prompt tokens whose KV
crossed from prefill to decode).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from hicache.errors import UserError

logger = logging.getLogger(__name__)

ENDPOINTS = ("completions", "chat")


@dataclass
class StreamResult:
    text: str = ""
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None
    transferred_tokens: int | None = None  # a P/D deployment's: prompt tokens whose KV crossed to decode
    error: str | None = None
    spec_proposed_tokens: int | None = None  # speculative decoding, where the server reports it
    spec_accepted_tokens: int | None = None


def build_payload(
    endpoint: str,
    model: str,
    messages: list[dict[str, str]],
    prompt_text: str,
    max_tokens: int,
    extra_body: dict[str, Any],
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one greedy streaming request. The completions endpoint gets the chat template
    already rendered (`prompt_text`), the chat endpoint the messages."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", messages
    else:
        path, body["prompt"] = "/v1/completions", prompt_text
    body.update(extra_body)
    return path, body


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            parts.append(choice.get("text") or "")
        else:
            parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _read_usage(result: StreamResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")
    # Accepted next to cached_tokens or directly in usage: servers differ on where extensions go.
    tiers = details.get("cached_tokens_by_tier") or usage.get("cached_tokens_by_tier")
    if isinstance(tiers, dict):
        result.cached_tokens_by_tier = {str(k): int(v) for k, v in tiers.items()}
    completion = usage.get("completion_tokens_details") or {}
    if "spec_proposed_tokens" in completion:
        result.spec_proposed_tokens = int(completion["spec_proposed_tokens"])
        result.spec_accepted_tokens = int(completion.get("spec_accepted_tokens") or 0)
    if isinstance(details.get("transferred_tokens"), int):
        result.transferred_tokens = details["transferred_tokens"]


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> StreamResult:
    """Sends one streaming request; never raises for a server or transport failure (it is recorded in
    `error`), so one bad request does not stop a benchmark."""
    result = StreamResult()
    pieces: list[str] = []
    start = time.perf_counter()
    last_chunk_at = start
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", errors="replace")[:500]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {chunk['error']}"
                    break
                text = _chunk_text(chunk)
                if text:
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last_chunk_at)
                    last_chunk_at = now
                    pieces.append(text)
                if chunk.get("usage"):
                    _read_usage(result, chunk["usage"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.latency_s = time.perf_counter() - start
        result.text = "".join(pieces)
    if result.error is None and result.ttft_s is None:
        result.error = "the stream carried no text"
    return result


async def flush_cache(client: httpx.AsyncClient, attempts: int = 20, retry_s: float = 0.5) -> bool:
    """POST /flush_cache. True when the server emptied its cache; False when it has no such endpoint.
    A 409 (requests still running) is retried: the warm-up's last streams may still be closing."""
    for _ in range(attempts):
        response = await _call(client, "POST", "/flush_cache")
        if response.status_code == 200:
            return True
        if response.status_code in (404, 405):
            logger.info("the server has no /flush_cache (HTTP %d); its cache is not flushed", response.status_code)
            return False
        if response.status_code != 409:
            raise RuntimeError(f"POST /flush_cache failed: HTTP {response.status_code}: {response.text[:200]}")
        await asyncio.sleep(retry_s)
    raise RuntimeError(f"POST /flush_cache still busy (HTTP 409) after {attempts} attempts")


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model id listed by GET /v1/models, for a server whose model name was not given."""
    response = await _call(client, "GET", "/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def _call(client: httpx.AsyncClient, method: str, path: str) -> httpx.Response:
    try:
        return await client.request(method, path)
    except httpx.TransportError as exc:
        raise UserError(f"cannot reach {client.base_url}: {type(exc).__name__}: {exc}") from None
