"""Work that ends when its HTTP client goes away: the server's generations and the router's pair of
upstream requests are cancelled then, instead of running to their end for nobody."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    pass


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (and `work` cancelled) if the client leaves first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientGone
    return task.result()
