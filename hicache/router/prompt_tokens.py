"""A request's prompt as token ids, for the cache-aware policy (docs/DESIGN.md, "router").

A completion's token ids are taken as given; any other prompt, and a chat's messages, are tokenized by
a server (`POST /tokenize`): its own tokenizer and chat template, so the page hashes the router
computes are the ones that server's KV events name, whatever model it serves and however its template
renders, with nothing for the router to load or keep in step. It costs one round trip to a server; one
that fails leaves the prompt unknown, and the request is routed by load alone.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 10.0


def _first_prompt(body: dict[str, Any]) -> object:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        return prompt[0]  # a batch: its first prompt stands for it
    return prompt


def _token_ids(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    return None


async def prompt_ids(
    client: httpx.AsyncClient, server_url: str, body: dict[str, Any], headers: dict[str, str]
) -> list[int] | None:
    """The token ids of the request's (first) prompt, or None when they cannot be known."""
    prompt = _first_prompt(body)
    if (ids := _token_ids(prompt)) is not None:
        return ids
    if "messages" in body:
        query = {"model": body.get("model"), "messages": body["messages"]}
    elif isinstance(prompt, str):
        query = {"model": body.get("model"), "prompt": prompt}
    else:
        return None  # malformed: the server it goes to will say why
    try:
        response = await client.post(f"{server_url}/tokenize", json=query, headers=headers, timeout=TOKENIZE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        logger.warning("tokenizing on %s failed (%s): routed by load", server_url, exc)
        return None
    if response.status_code != 200:
        return None  # a bad request: the server it goes to answers the error
    return _token_ids(response.json().get("tokens"))
