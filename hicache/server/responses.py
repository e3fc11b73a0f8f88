"""Serving: OpenAI response objects — completions and chat completions, whole or as stream chunks — and
the usage block with hicache's per-tier cached-token counts.

The two endpoints differ only in these shapes; `CompletionFormat` and `ChatFormat` give the route code
one interface, so generation, streaming and error handling are written once.

In a P/D decode server's usage, `cached_tokens` (and its tiers) are prefill's: the prompt tokens whose
computation was skipped, never more than `prompt_tokens`. Decode's own reuse is reported apart, as
`decode_prefix_tokens` (the page-aligned prefix it served from its tree, so prefill did not send it)
and `transferred_tokens` (the prompt tokens whose KV arrived); the two add up to `prompt_tokens`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

from hicache.cache import TIERS
from hicache.model.tokenizer import Tokenizer
from hicache.scheduler.request import TokenLogprob
from hicache.server.bridge import Choice

# JSON has no -inf; OpenAI-compatible servers report an impossible token's log-probability like this.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def disagg_details(choices: Sequence[Choice]) -> dict[str, int]:
    """The P/D fields of `usage.prompt_tokens_details` (none on a server without a decode role)."""
    reports = [c.disagg for c in choices if c.disagg is not None]
    if not reports:
        return {}
    return {
        "decode_prefix_tokens": sum(r.decode_prefix_tokens for r in reports),
        "transferred_tokens": sum(r.transferred_tokens for r in reports),
    }


def usage(choices: Sequence[Choice]) -> dict:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(len(c.token_ids) for c in choices)
    by_tier = {tier: sum(c.cached_tokens_by_tier.get(tier, 0) for c in choices) for tier in TIERS}
    details: dict = {"cached_tokens": sum(by_tier.values()), "cached_tokens_by_tier": by_tier}
    details.update(disagg_details(choices))
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }
    spec = [c.spec_tokens for c in choices if c.spec_tokens is not None]
    if spec:  # speculative decoding: the draft's proposals and how many the target accepted
        out["completion_tokens_details"] = {
            "spec_proposed_tokens": sum(p for p, _ in spec),
            "spec_accepted_tokens": sum(a for _, a in spec),
        }
    return out


class ResponseFormat(Protocol):
    def opening_chunks(self, n: int) -> list[dict]: ...

    def delta_chunk(self, index: int, text: str, logprobs: Sequence[TokenLogprob]) -> dict: ...

    def finish_chunk(self, index: int, finish_reason: str) -> dict: ...

    def usage_chunk(self, usage: dict) -> dict: ...

    def response(self, choices: Sequence[Choice], texts: Sequence[str]) -> dict: ...


class _Format:
    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, tokenizer: Tokenizer, include_usage: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {
            "id": self.id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
        return chunk

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._chunk([]), "usage": usage}

    def _response(self, choices: list[dict], finished: Sequence[Choice]) -> dict:
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(finished),
        }


class CompletionFormat(_Format):
    """/v1/completions, with the legacy logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, tokenizer: Tokenizer, include_usage: bool = False) -> None:
        super().__init__(model, tokenizer, include_usage)
        self._offsets: dict[int, int] = {}  # per choice: text offset of the next token, for streamed logprobs

    def _logprobs(self, index: int, logprobs: Sequence[TokenLogprob], wanted: bool) -> dict | None:
        if not wanted:
            return None
        tokens, offsets = [], []
        offset = self._offsets.get(index, 0)
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        top = []
        for lp in logprobs:
            alternatives: dict[str, float] = {}
            for token_id, value in lp.top:
                # Distinct ids can decode alike (partial UTF-8 bytes); keep the likelier, listed first.
                alternatives.setdefault(self._token_text(token_id), _finite(value))
            top.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def opening_chunks(self, n: int) -> list[dict]:
        return []

    def delta_chunk(self, index: int, text: str, logprobs: Sequence[TokenLogprob]) -> dict:
        lp = self._logprobs(index, logprobs, bool(logprobs))
        return self._chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": None}])

    def finish_chunk(self, index: int, finish_reason: str) -> dict:
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}])

    def response(self, choices: Sequence[Choice], texts: Sequence[str]) -> dict:
        out = []
        for choice, text in zip(choices, texts, strict=True):
            lp = self._logprobs(choice.index, choice.logprobs, choice.wants_logprobs)
            out.append(
                {
                    "index": choice.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": choice.finish_reason.value if choice.finish_reason else None,
                }
            )
        return self._response(out, choices)


class ChatFormat(_Format):
    """/v1/chat/completions, with chat logprobs (content: token, logprob, bytes, top_logprobs)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, logprobs: Sequence[TokenLogprob], wanted: bool) -> dict | None:
        if not wanted:
            return None
        content = [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
        return {"content": content}

    def opening_chunks(self, n: int) -> list[dict]:
        # The role comes first, before any token, as OpenAI streams it.
        return [
            self._chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            for i in range(n)
        ]

    def delta_chunk(self, index: int, text: str, logprobs: Sequence[TokenLogprob]) -> dict:
        lp = self._logprobs(logprobs, bool(logprobs))
        return self._chunk([{"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}])

    def finish_chunk(self, index: int, finish_reason: str) -> dict:
        return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])

    def response(self, choices: Sequence[Choice], texts: Sequence[str]) -> dict:
        out = []
        for choice, text in zip(choices, texts, strict=True):
            out.append(
                {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self._logprobs(choice.logprobs, choice.wants_logprobs),
                    "finish_reason": choice.finish_reason.value if choice.finish_reason else None,
                }
            )
        return self._response(out, choices)
