"""End to end with the official `openai` client against real `hicache serve` processes: completions,
chat, streaming with usage, logprobs, stop strings, and a second conversation turn served from cache
with exactly the answer of a server whose cache is off."""

from __future__ import annotations

import httpx
import openai
import pytest

from hicache.config.cpu import cpu_has_native_bf16

GREEDY = {"temperature": 0.0}
SYSTEM = "You are a terse assistant. Answer in one short line, and never repeat the question back. "


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(server: str) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok"
    assert health["batch_invariance"]["verified"] is True, health  # the start-up self-check passed here
    assert health["batch_invariance"]["thread_count_invariant"] is True, health  # any TP size computes these bits
    # what the defaults resolved to here: tiny's weights are dense, so its activations are the CPU's fastest dense dtype
    dense = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert (health["weight_format"], health["weight_kernels"], health["dtype"]) == ("none", "dense", dense), health


def test_completion(server: str) -> None:
    r = client(server).completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, **GREEDY)
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == len(b"Once upon a time")
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    tiers = r.usage.prompt_tokens_details.cached_tokens_by_tier
    assert set(tiers) == {"device", "host", "storage"}
    assert sum(tiers.values()) == r.usage.prompt_tokens_details.cached_tokens


def test_token_id_prompt_equals_text_prompt(server: str) -> None:
    c = client(server)
    text = c.completions.create(model="tiny", prompt="abc", max_tokens=8, **GREEDY).choices[0].text
    ids = c.completions.create(model="tiny", prompt=list(b"abc"), max_tokens=8, **GREEDY).choices[0].text
    assert ids == text


def test_batch_of_prompts(server: str) -> None:
    c = client(server)
    prompts = ["First prompt", "Second prompt, longer", "Third"]
    alone = [c.completions.create(model="tiny", prompt=p, max_tokens=8, **GREEDY).choices[0].text for p in prompts]
    batch = c.completions.create(model="tiny", prompt=prompts, max_tokens=8, **GREEDY)
    assert [ch.index for ch in batch.choices] == [0, 1, 2]
    assert [ch.text for ch in batch.choices] == alone
    assert batch.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)
    assert batch.usage.completion_tokens == 24
    chunks = list(c.completions.create(model="tiny", prompt=prompts, max_tokens=8, stream=True, **GREEDY))
    streamed = ["".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in range(3)]
    assert streamed == alone


def test_chat(server: str) -> None:
    r = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_completion_tokens=10, **GREEDY
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_with_usage_equals_the_whole_answer(server: str, endpoint: str) -> None:
    c = client(server)
    if endpoint == "completions":
        args = {"model": "tiny", "prompt": "Stream me a story", "max_tokens": 40, **GREEDY}
        whole = c.completions.create(**args)
        chunks = list(c.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        expected = whole.choices[0].text
    else:
        args = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Stream me a story"}],
            "max_tokens": 40,
            **GREEDY,
        }
        whole = c.chat.completions.create(**args)
        chunks = list(c.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        expected = whole.choices[0].message.content
    assert streamed == expected
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert all(ch.usage is None for ch in chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 40
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # The second run of the same prompt is served from cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_stop_string_ends_the_stream_before_it(server: str) -> None:
    c = client(server)
    args = {"model": "tiny", "prompt": "Find the stop string", "max_tokens": 60, **GREEDY}
    text = c.completions.create(**args).choices[0].text
    # A stop string cut from the greedy answer itself: two printable ASCII characters.
    at = next(i for i in range(5, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isprintable())
    stop = text[at : at + 2]
    chunks = list(c.completions.create(**args, stop=[stop, "\u2603never"], stream=True))
    streamed = "".join(ch.choices[0].text for ch in chunks)
    assert streamed == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    whole = c.completions.create(**args, stop=stop)
    assert whole.choices[0].text == streamed and whole.choices[0].finish_reason == "stop"


def test_logprobs(server: str) -> None:
    r = client(server).completions.create(model="tiny", prompt="Log me", max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()), abs=1e-5)
    chat = client(server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Log me"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)


def test_second_turn_is_cached_and_unchanged(servers: dict[str, str]) -> None:
    def converse(url: str) -> list:
        c = client(url)
        messages = [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "What is a cache?"}]
        turns = []
        for question in ("Why does reuse help?", None):
            r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, **GREEDY)
            turns.append(r)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            if question:
                messages.append({"role": "user", "content": question})
        return turns

    cached, uncached = converse(servers["cache"]), converse(servers["nocache"])
    assert [t.choices[0].message.content for t in cached] == [t.choices[0].message.content for t in uncached]
    second = cached[1].usage.prompt_tokens_details
    assert second.cached_tokens >= len((SYSTEM * 3).encode()) // 16 * 16  # at least the history's full pages
    assert second.cached_tokens_by_tier["device"] == second.cached_tokens
    assert all(t.usage.prompt_tokens_details.cached_tokens == 0 for t in uncached)


def test_cache_salt_separates_caches(server: str) -> None:
    c = client(server)
    prompt = "A history that only one tenant may reuse. " * 3

    def cached(salt: str) -> int:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_flush_is_refused_while_a_request_runs(server: str) -> None:
    c = client(server)
    stream = c.completions.create(model="tiny", prompt="Busy", max_tokens=2000, stream=True, **GREEDY)
    next(iter(stream))
    refused = httpx.post(f"{server}/flush_cache", timeout=10)
    assert refused.status_code == 409 and "running" in refused.json()["error"]["message"]
    stream.close()


def test_errors_reach_the_client_as_api_errors(server: str) -> None:
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="not-served", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x" * 5000, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", max_tokens=10**6)
