"""`hicache router` in front of real prefill and decode servers: what a client sees through it equals a
single non-disaggregated cache-off server, streamed or not, completions and chat, turn after turn;
the transferred tokens read from decode's metrics are prompt - decode_prefix_len (the whole prompt
without decode reuse); under --policy cache-aware a conversation keeps meeting the prefill and the
decode server that hold its history; bad input gets an OpenAI-style 4xx and the router keeps serving; a server of
the wrong role is refused at start-up."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from hicache.router.policies import FirstMessage
from hicache.router.upstreams import Upstream
from tests.disagg.deployment import (
    DECODE_PLAIN,
    DECODE_REUSE,
    complete,
    decode_counters,
    ports,
    prefill_args,
    router,
    router_refusal,
    serve,
    started,
)
from tests.disagg.pd import free_ports
from tests.server.server_harness import assert_no_leaks, metric, scrape

PAGE = 16


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("pd")
    p_port, p2_port, d_port, plain_port, ref_port, r_port, r_plain_port, r_many_port, boot, boot2, r_aware_port = (
        ports(11)
    )
    events = [("--kv-events-endpoint", f"tcp://127.0.0.1:{free_ports(2)}") for _ in range(3)]
    prefill = serve(logs, p_port, *prefill_args(boot, *events[0]))
    prefill2 = serve(logs, p2_port, *prefill_args(boot2, *events[1]))
    decode = serve(logs, d_port, *DECODE_REUSE, *events[2])
    plain = serve(logs, plain_port, *DECODE_PLAIN)
    ref = serve(logs, ref_port, "--disable-radix-cache")
    with started(prefill, prefill2, decode, plain, ref):
        front = router(logs, r_port, [prefill.url], [decode.url])
        front_plain = router(logs, r_plain_port, [prefill.url], [plain.url])
        many = router(logs, r_many_port, [prefill.url, prefill2.url], [decode.url, plain.url])
        aware = router(logs, r_aware_port, [prefill.url, prefill2.url], [decode.url, plain.url],
                       "--policy", "cache-aware")  # fmt: skip
        with started(front, front_plain, many, aware):
            yield {"router": front.url, "router_plain": front_plain.url, "router_many": many.url,
                   "router_aware": aware.url, "prefill": prefill.url, "prefill2": prefill2.url,
                   "decode": decode.url, "plain": plain.url, "ref": ref.url}  # fmt: skip
            for server in (prefill, prefill2, decode, plain, front, front_plain, many, aware):
                assert "Traceback" not in server.log.read_text(), server.log_tail()


def stream_text(url: str, path: str, body: dict) -> tuple[str, dict]:
    """The text and the usage of a streamed response (the SSE events as the client reads them)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], {}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage") or usage
    return "".join(text), usage


@pytest.mark.slow
def test_through_the_router_equals_one_cache_off_server(deployment):
    ref = deployment["ref"]
    history = "You are a careful assistant. " * 12
    messages = [{"role": "system", "content": "Answer in one line. " * 10}]
    for turn in range(3):
        history += f" Question {turn}: what comes after {turn}?"
        messages.append({"role": "user", "content": f"Turn {turn}: tell me about caches."})
        expected = complete(ref, history, logprobs=2).json()["choices"][0]
        chat = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0}
        expected_chat = httpx.post(f"{ref}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
        for front in (deployment["router"], deployment["router_plain"]):
            got = complete(front, history, logprobs=2).json()
            assert got["choices"][0]["text"] == expected["text"], f"turn {turn}"
            assert got["choices"][0]["logprobs"] == expected["logprobs"], f"turn {turn}: logprobs differ"
            usage = got["usage"]
            details = usage["prompt_tokens_details"]
            assert details["cached_tokens"] <= usage["prompt_tokens"]
            assert details["decode_prefix_tokens"] + details["transferred_tokens"] == usage["prompt_tokens"]
            body = {"model": "tiny", "prompt": history, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            text, streamed_usage = stream_text(front, "/v1/completions", body)
            assert text == expected["text"], f"turn {turn}: the streamed text differs"
            assert streamed_usage["prompt_tokens"] == usage["prompt_tokens"]
            got_chat = httpx.post(f"{front}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
            assert got_chat["message"] == expected_chat["message"]
            text, _ = stream_text(front, "/v1/chat/completions", chat)
            assert text == expected_chat["message"]["content"]
        history += expected["text"]
        messages.append({"role": "assistant", "content": expected_chat["message"]["content"]})


@pytest.mark.slow
def test_transferred_tokens_are_prompt_minus_decode_prefix_len(deployment):
    history = list(range(40, 120)) * 3  # token ids: exact lengths
    for turn in range(4):
        for front, decode, reuse in ((deployment["router"], deployment["decode"], True),
                                     (deployment["router_plain"], deployment["plain"], False)):  # fmt: skip
            before = decode_counters(decode)
            usage = complete(front, history).json()["usage"]
            after = decode_counters(decode)
            details = usage["prompt_tokens_details"]
            d = details["decode_prefix_tokens"]
            received = after["received"] - before["received"]
            assert received == usage["prompt_tokens"] - d == details["transferred_tokens"]
            assert sum(after[t] - before[t] for t in ("device", "host", "storage")) == d
            assert d % PAGE == 0
            if not reuse:
                assert d == 0 and received == len(history), "decode reuse off: the whole prompt is transferred"
            elif turn:
                assert d >= len(history) - 60 - PAGE, f"turn {turn}: decode reuses the conversation so far"
            assert after["bytes"] > before["bytes"]
        history += list(range(60 + turn, 112 + turn))  # the next turn's answer and question


@pytest.mark.slow
def test_several_servers_of_each_role_share_the_requests(deployment):
    front, ref = deployment["router_many"], deployment["ref"]
    sent = {
        name: metric(scrape(deployment[name]), "hicache_disagg_sent_tokens_total") for name in ("prefill", "prefill2")
    }
    for i in range(12):
        prompt = f"Conversation {i} starts here with its own system prompt. " * 3
        got = complete(front, prompt)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == complete(ref, prompt).json()["choices"][0]["text"]
    for name, before in sent.items():
        assert metric(scrape(deployment[name]), "hicache_disagg_sent_tokens_total") > before, f"{name} served none"
    for name in ("decode", "plain"):
        assert metric(scrape(deployment[name]), "hicache_disagg_transfers_total", outcome="ok") > 0


@pytest.mark.slow
def test_cache_aware_picks_the_prefill_and_the_decode_server_each_by_its_own_cache(deployment):
    """Turn after turn, a conversation meets the prefill server that computed its history (a hit there)
    and the decode server that kept it (its decode prefix grows); answers equal a cache-off server's."""
    front, ref, names = deployment["router_aware"], deployment["ref"], ("prefill", "prefill2")
    groups = [[Upstream(deployment[name], "", "tiny", None) for name in group]
              for group in (names, ("decode", "plain"))]  # fmt: skip

    def first_message_decode(prompt: list[int]) -> str:
        return asyncio.run(FirstMessage().choose({"prompt": prompt}, groups, {})).servers[1].url

    # Token ids (exact lengths) shared with no other test's prompts, whose head first-message would send
    # to the decode server without a cache: under that policy no turn would find its history there.
    offset = next(k for k in range(140, 200) if first_message_decode([k] * 240) == deployment["plain"])
    history = [offset] * 240
    served = []
    for turn in range(3):
        before = [scrape(deployment[name]) for name in names]
        got = complete(front, history).json()
        after = [scrape(deployment[name]) for name in names]
        assert got["choices"][0]["text"] == complete(ref, history).json()["choices"][0]["text"], f"turn {turn}"
        sent = [metric(a, "hicache_disagg_sent_tokens_total") - metric(b, "hicache_disagg_sent_tokens_total")
                for a, b in zip(after, before)]  # fmt: skip
        (server,) = [i for i in range(2) if sent[i] > 0]
        hit = metric(after[server], "hicache_cached_tokens_total", tier="device") - metric(
            before[server], "hicache_cached_tokens_total", tier="device"
        )
        decode_prefix = got["usage"]["prompt_tokens_details"]["decode_prefix_tokens"]
        if turn:
            assert server == served[0], f"turn {turn} goes to the prefill server holding the history"
            assert hit >= len(history) - 60 - PAGE, f"turn {turn}: prefill reuses the history"
            assert decode_prefix >= len(history) - 60 - PAGE, f"turn {turn}: the decode server that kept it"
        served.append(server)
        time.sleep(0.3)  # a user's next turn comes later than the events of this one
        history += list(range(60 + turn, 112 + turn))  # the next turn's answer and question


@pytest.mark.slow
def test_bad_input_gets_an_openai_error_and_the_router_keeps_serving(deployment):
    front = deployment["router"]
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_value"),
        (json.dumps({"model": "tiny", "prompt": "hi", "temperature": "hot"}).encode(), 400, "invalid_value"),
        (json.dumps({"model": "other", "prompt": "hi"}).encode(), 404, "model_not_found"),
        (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 10**6}).encode(), 400, None),
    ]
    for raw, status, code in cases:
        r = httpx.post(f"{front}/v1/completions", content=raw, timeout=30)
        assert r.status_code == status, (raw, r.text)
        error = r.json()["error"]
        assert error["message"] and (code is None or error["code"] == code), error
    r = httpx.get(f"{front}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{front}/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(f"{deployment['decode']}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
    assert r.status_code == 400 and "hicache router" in r.json()["error"]["message"], "P/D servers need the router"
    assert complete(front, "still serving").status_code == 200
    assert httpx.post(f"{front}/flush_cache", timeout=30).status_code == 200
    for name in ("prefill", "decode"):
        assert_no_leaks(deployment[name])


@pytest.mark.slow
def test_a_server_of_the_wrong_role_is_refused_at_start_up(deployment):
    refusal = router_refusal(deployment["prefill"], deployment["ref"])
    assert "--disaggregation-mode null, but was given as a decode server" in refusal
