"""A fake OpenAI-compatible server on an `httpx.MockTransport`, for testing the benchmark without a
model: answers are deterministic letters, and `cached_tokens` comes from an exact prefix cache that
holds every prompt from the moment it arrives and every prompt + answer once answered (the benchmark's
"infinite cache"), matched by brute force so that the test does not reuse the code it checks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from hicache.model.tokenizer import Tokenizer


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class FakeOpenAIServer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        report_tiers: bool = True,
        flush_status: int = 200,
        fail_prompts_containing: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.report_tiers = report_tiers
        self.flush_status = flush_status
        self.fail_prompts_containing = fail_prompts_containing
        self.held: list[list[int]] = []
        self.prompts: list[str] = []  # every prompt received, in arrival order
        self.answers: dict[str, str] = {}  # prompt -> answer
        self.bodies: list[dict] = []
        self.flushes = 0

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/flush_cache":
            if self.flush_status == 200:
                self.held.clear()
                self.flushes += 1
            return httpx.Response(self.flush_status, json={})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        chat = path == "/v1/chat/completions"
        prompt = self.tokenizer.chat_template.render(body["messages"]) if chat else body["prompt"]
        if self.fail_prompts_containing and self.fail_prompts_containing in prompt:
            return httpx.Response(500, json={"error": {"message": "injected failure"}})
        ids = self.tokenizer.encode(prompt)
        cached = max((_common(ids, seq) for seq in self.held), default=0)
        self.held.append(ids)
        self.prompts.append(prompt)
        answer = "".join("abcdefghij"[(len(ids) + i) % 10] for i in range(body["max_tokens"]))
        self.answers[prompt] = answer
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=self._stream(ids, answer, cached, chat)
        )

    async def _stream(self, ids: list[int], answer: str, cached: int, chat: bool) -> AsyncIterator[bytes]:
        for char in answer:
            await asyncio.sleep(0.001)  # lets other conversations interleave, and gives ITLs a size
            choice = {"index": 0, "delta": {"content": char}} if chat else {"index": 0, "text": char}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
        self.held.append(ids + self.tokenizer.encode(answer))
        details: dict = {"cached_tokens": cached}
        if self.report_tiers:
            details["cached_tokens_by_tier"] = {"device": cached - cached // 3, "host": cached // 3, "storage": 0}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(answer), "prompt_tokens_details": details}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"
