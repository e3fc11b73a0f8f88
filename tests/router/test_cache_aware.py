"""`hicache router --policy cache-aware` in front of two real plain servers that publish KV events: a
conversation's second turn goes where its first was served and hits there (the server's /metrics say
so), including where first-message hashing sends it to the other server; what the client reads through
it equals a cache-off server's answer; a router whose events endpoints are dead still serves, by load;
a server of another engine (no /disagg/info) is taken by its /v1/models, its page size from its events."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from hicache.errors import UserError
from hicache.router.cache_view import CacheView
from hicache.router.policies import FirstMessage
from hicache.router.upstreams import PLAIN, Upstream, discover
from tests.disagg.deployment import ports, serve, spawn, started
from tests.disagg.pd import free_ports
from tests.server.server_harness import metric, scrape

PAGE = 16
SYSTEM_CHARS = 400  # the tiny model's tokens are bytes: 25 pages of history per conversation
EVENTS_SETTLE_S = 0.3  # a user's next turn comes later than this: the first turn's pages are published


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("router")
    a_port, b_port, ref_port, aware_port, dead_port = ports(5)
    events = [f"tcp://127.0.0.1:{free_ports(2)}" for _ in range(2)]
    a = serve(logs, a_port, "--kv-events-endpoint", events[0])
    b = serve(logs, b_port, "--kv-events-endpoint", events[1])
    ref = serve(logs, ref_port, "--disable-radix-cache")
    with started(a, b, ref):  # before the routers: five start-ups at once share two cores too thinly
        servers = ["--server", a.url, "--server", b.url, "--policy", "cache-aware", "--startup-timeout", "60"]
        aware = spawn(logs, aware_port, "router", *servers)
        nowhere = [f"tcp://127.0.0.1:{free_ports(2)}" for _ in range(2)]  # nobody publishes there
        dead = spawn(logs, dead_port, "router", *servers,
                     "--kv-events", f"{a.url}={nowhere[0]}", "--kv-events", f"{b.url}={nowhere[1]}")  # fmt: skip
        with started(aware, dead):
            yield {"servers": [a.url, b.url], "ref": ref.url, "aware": aware.url, "dead": dead.url, "events": events}
    for process in (a, b, aware, dead):
        assert "Traceback" not in process.log.read_text(), process.log_tail()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(url: str, messages: list[dict]) -> str:
    answer = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    return answer.choices[0].message.content or ""


def counters(urls: list[str]) -> list[tuple[float, float]]:
    """Per server: prompt tokens admitted, prompt tokens served from its device cache."""
    out = []
    for url in urls:
        samples = scrape(url)
        out.append((metric(samples, "hicache_prompt_tokens_total"),
                    metric(samples, "hicache_cached_tokens_total", tier="device")))  # fmt: skip
    return out


def served_by(router: str, urls: list[str], messages: list[dict]) -> tuple[str, int, int]:
    """Send one turn through `router`: (its answer, which server admitted it, tokens it had cached)."""
    before = counters(urls)
    text = chat(router, messages)
    after = counters(urls)
    admitted = [i for i in range(len(urls)) if after[i][0] > before[i][0]]
    assert len(admitted) == 1, f"one server serves a turn: {before} -> {after}"
    i = admitted[0]
    return text, i, int(after[i][1] - before[i][1])


def first_message_pick(messages: list[dict], urls: list[str]) -> int:
    servers = [Upstream(url, PLAIN, "tiny", None) for url in urls]
    routing = asyncio.run(FirstMessage().choose({"messages": messages}, [servers], {}))
    return servers.index(routing.servers[0])


def conversations(urls: list[str], n: int) -> list[list[dict]]:
    """`n` conversations whose first messages all hash to the first server under first-message: a
    cache-aware router, spreading new conversations, sends some of them to the second."""
    out: list[list[dict]] = []
    nonce = 0
    while len(out) < n:
        nonce += 1
        system = f"{nonce}: keep the whole history of this chat in mind. " * 12  # no page shared with another
        messages = [{"role": "system", "content": system[:SYSTEM_CHARS]}, {"role": "user", "content": "Hello."}]
        if first_message_pick(messages, urls) == 0:
            out.append(messages)
    return out


@pytest.mark.slow
def test_a_second_turn_goes_where_the_first_was_served(fleet):
    urls = fleet["servers"]
    convs = conversations(urls, 4)
    first = []
    for messages in convs:
        text, server, cached = served_by(fleet["aware"], urls, messages)
        assert text == chat(fleet["ref"], messages)
        assert cached == 0, "a new conversation: nothing of it is cached anywhere"
        first.append(server)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    assert set(first) == {0, 1}, "new conversations, nothing cached: spread by load"
    time.sleep(EVENTS_SETTLE_S)
    for messages, server in zip(convs, first):
        text, again, cached = served_by(fleet["aware"], urls, messages)
        assert again == server, "the second turn goes where the first was served"
        assert cached >= SYSTEM_CHARS // PAGE * PAGE, "and hits its history there"
        assert text == chat(fleet["ref"], messages), "the cache changed no answer"
    elsewhere = [i for i, server in enumerate(first) if first_message_pick(convs[i], urls) != server]
    assert elsewhere, "first-message would have sent some second turns to the server without their history"


@pytest.mark.slow
def test_with_dead_events_endpoints_the_router_serves_by_load(fleet):
    urls = fleet["servers"]
    landed = set()
    for i in range(2):
        messages = [{"role": "system", "content": f"Dead events {i}. " * 20}, {"role": "user", "content": "Hi."}]
        text, server, _ = served_by(fleet["dead"], urls, messages)
        assert text == chat(fleet["ref"], messages)
        landed.add(server)
    assert landed == {0, 1}, "nothing known of any cache: the least loaded, in turn"


@pytest.mark.slow
def test_a_servers_tokenize_is_what_it_admits(fleet):
    """What the cache-aware router hashes is the prompt the server computes, chat template included (a
    batch: its first prompt); a wrong model is refused as a generation would be."""
    url = fleet["servers"][0]
    messages = [{"role": "system", "content": "Tokenize me."}, {"role": "user", "content": "Twice."}]
    cases = [({"messages": messages}, "/v1/chat/completions", {"messages": messages}),
             ({"prompt": "A plain prompt."}, "/v1/completions", {"prompt": "A plain prompt."}),
             ({"prompt": ["First of a batch.", "x"]}, "/v1/completions", {"prompt": "First of a batch."})]  # fmt: skip
    for query, path, body in cases:
        tokens = httpx.post(f"{url}/tokenize", json={"model": "tiny", **query}, timeout=30).json()
        usage = httpx.post(f"{url}{path}", json={"model": "tiny", **body, "max_tokens": 1}, timeout=30).json()["usage"]
        assert tokens["count"] == len(tokens["tokens"]) == usage["prompt_tokens"], query
    wrong = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"}, timeout=30)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


@pytest.mark.slow
def test_a_server_without_disagg_info_is_another_engines_and_its_events_give_its_page_size(fleet):
    """A vLLM server has no /disagg/info; neither has a router, an OpenAI-compatible server at hand here:
    it is found as a plain server named by its /v1/models, with no page size of its own word; one whose
    events say theirs (a hicache server, told nothing) gets it from them. Neither half of a P/D pair."""

    async def find(url: str, role: str) -> Upstream:
        async with httpx.AsyncClient() as probe:
            return await discover(probe, url, role, 10.0, kv_events=fleet["events"][0])

    other = asyncio.run(find(fleet["aware"], PLAIN))
    assert (other.served_model_name, other.page_size, other.handshake) == ("tiny", None, None)
    with pytest.raises(UserError, match="cannot be a prefill server"):
        asyncio.run(find(fleet["aware"], "prefill"))
    told_nothing = Upstream(
        fleet["servers"][0], PLAIN, "tiny", None, kv_events_endpoint=fleet["events"][0], page_size=None
    )
    view = CacheView([told_nothing])
    try:
        deadline = time.monotonic() + 30
        while view.page_size(told_nothing) is None and time.monotonic() < deadline:
            chat(told_nothing.url, [{"role": "user", "content": f"Page size, please. {time.monotonic()} " * 4}])
            time.sleep(EVENTS_SETTLE_S)
        assert view.page_size(told_nothing) == PAGE
    finally:
        view.close()
