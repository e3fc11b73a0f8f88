"""Many streams share the continuous batch and still give the one-by-one answers; a client that goes
away mid-stream cancels its request; afterwards a flush leaves no page or lock behind."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.server_harness import assert_no_leaks, metric, scrape

CONVERSATIONS = 32
MAX_TOKENS = 10
SYSTEM = "You answer questions about caches for a software team, briefly. "


def conversation(i: int) -> list[dict]:
    # A shared system prompt (so the streams also share cached pages) and a question of their own.
    return [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": f"Question {i}: what is {i} * {i}?"}]


async def run_conversation(client: openai.AsyncOpenAI, i: int, stream: bool) -> list[str]:
    """Two turns; the second carries the first answer, as a chat client would send it."""
    messages = conversation(i)
    answers = []
    for follow_up in (f"And {i} + {i}?", None):
        args = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        if stream:
            chunks = await client.chat.completions.create(**args, stream=True)
            answer = "".join([ch.choices[0].delta.content or "" async for ch in chunks])
        else:
            answer = (await client.chat.completions.create(**args)).choices[0].message.content
        answers.append(answer)
        messages = [*messages, {"role": "assistant", "content": answer}]
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return answers


async def peak_running(url: str, done: asyncio.Event) -> int:
    """The largest batch seen on /metrics while the streams run."""
    peak = 0
    async with httpx.AsyncClient() as http:
        while not done.is_set():
            text = (await http.get(f"{url}/metrics")).text
            line = next(ln for ln in text.splitlines() if ln.startswith("hicache_requests_running "))
            peak = max(peak, int(float(line.split()[1])))
            await asyncio.sleep(0.1)
    return peak


async def one_by_one_then_together(url: str) -> tuple[list, list, int]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        alone = [await run_conversation(client, i, stream=False) for i in range(CONVERSATIONS)]
        assert httpx.post(f"{url}/flush_cache").status_code == 200  # the concurrent run starts cold
        done = asyncio.Event()
        watcher = asyncio.create_task(peak_running(url, done))
        together = await asyncio.gather(*(run_conversation(client, i, stream=True) for i in range(CONVERSATIONS)))
        done.set()
    return alone, list(together), await watcher


@pytest.mark.slow
def test_concurrent_streams_match_sequential_answers(server: str) -> None:
    alone, together, peak = asyncio.run(one_by_one_then_together(server))
    assert together == alone
    assert peak > 1, "the streams never shared a batch"
    assert_no_leaks(server)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_request(server: str, stream: bool) -> None:
    before = scrape(server)
    body = {
        "model": "tiny",
        "prompt": "Talk for a long time.",
        "max_tokens": 4000,
        "ignore_eos": True,  # tiny could otherwise end early with EOS
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
    else:
        # 4000 tokens take seconds on tiny: the client gives up (and closes the connection) long before.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", json=body, timeout=0.5)
    # The connection is closed now; the server notices, cancels, and the request leaves the batch.
    deadline = time.monotonic() + 10
    while True:
        after = scrape(server)
        aborted = metric(after, "hicache_requests_total", status="abort") - metric(
            before, "hicache_requests_total", status="abort"
        )
        if (aborted and not metric(after, "hicache_requests_running")) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert aborted == 1
    generated = metric(after, "hicache_generation_tokens_total") - metric(before, "hicache_generation_tokens_total")
    assert generated < 4000
    assert_no_leaks(server)
