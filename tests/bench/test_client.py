"""The streaming client on hand-written SSE streams: TTFT/ITL from text chunks, usage wherever the server
puts the per-tier split, errors recorded rather than raised, and /flush_cache's 409 retried, 404 tolerated."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hicache.bench.client import build_payload, flush_cache, stream_request


def sse(*chunks: object) -> bytes:
    return b"".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks)


def run(transport: httpx.MockTransport, coro_fn):
    async def main():
        async with httpx.AsyncClient(base_url="http://x", transport=transport) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def test_text_timing_and_usage_at_the_top_level() -> None:
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 4},
        "cached_tokens_by_tier": {"device": 4, "host": 0, "storage": 0},
    }
    body = sse(
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {"content": ""}}]},
        {"choices": [{"delta": {"content": "bc"}}]},
        {"choices": [], "usage": usage},
        "[DONE]",
    )
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    result = run(transport, lambda c: stream_request(c, "/v1/chat/completions", {}))
    assert result.error is None and result.text == "abc"
    assert result.ttft_s is not None and len(result.itl_s) == 1  # two text chunks, one gap
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (9, 3, 4)
    assert result.cached_tokens_by_tier == {"device": 4, "host": 0, "storage": 0}


@pytest.mark.parametrize(
    "response, error",
    [
        (httpx.Response(400, json={"error": {"message": "too long"}}), "HTTP 400"),
        (httpx.Response(200, content=sse({"choices": [{"text": "a"}]}, {"error": {"message": "boom"}})), "boom"),
        (httpx.Response(200, content=sse({"choices": [], "usage": {"prompt_tokens": 1}}, "[DONE]")), "no text"),
        (httpx.Response(200, content=b"data: {not json\n\n"), "JSONDecodeError"),
    ],
)
def test_failures_are_recorded(response: httpx.Response, error: str) -> None:
    result = run(httpx.MockTransport(lambda request: response), lambda c: stream_request(c, "/v1/completions", {}))
    assert error in (result.error or "")


def test_flush_retries_while_busy_and_tolerates_no_endpoint() -> None:
    codes = iter([409, 409, 200])
    busy = httpx.MockTransport(lambda request: httpx.Response(next(codes)))
    assert run(busy, lambda c: flush_cache(c, retry_s=0.0)) is True
    missing = httpx.MockTransport(lambda request: httpx.Response(404))
    assert run(missing, lambda c: flush_cache(c)) is False


def test_payloads() -> None:
    messages = [{"role": "user", "content": "q"}]
    path, body = build_payload("chat", "m", messages, "", 7, {"ignore_eos": True})
    assert path == "/v1/chat/completions" and body["messages"] == messages and "prompt" not in body
    assert body["max_tokens"] == 7 and body["stream"] and body["stream_options"] == {"include_usage": True}
    path, body = build_payload("completions", "m", messages, "user: q\nassistant:", 7, {})
    assert path == "/v1/completions" and body["prompt"] == "user: q\nassistant:" and "ignore_eos" not in body


def test_the_drafts_counts_are_read_from_the_usage() -> None:
    usage = {"prompt_tokens": 9, "completion_tokens": 3,
             "completion_tokens_details": {"spec_proposed_tokens": 6, "spec_accepted_tokens": 2}}  # fmt: skip
    body = sse({"choices": [{"text": "abc"}]}, {"choices": [], "usage": usage}, "[DONE]")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    result = run(transport, lambda c: stream_request(c, "/v1/completions", {}))
    assert (result.spec_proposed_tokens, result.spec_accepted_tokens) == (6, 2)
