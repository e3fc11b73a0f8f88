"""A fleet over several hosts (network namespaces of this machine, tests/fleet/netns.py): `hicache
router --policy cache-aware`, two `hicache serve` servers and a Redis server each on a host of its own,
the servers sharing the Redis store and publishing KV events. A conversation's second turn goes where its
first was served and hits there; a server that never saw it reads its prefix from the shared store; and
a TP2 server whose two ranks sit on two hosts (--nnodes 2) answers as one cache-off rank does. Every
answer equals the cache-off single-rank reference; all traffic stays on the namespaces' own network.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from hicache import Engine, SamplingParams
from tests.disagg.deployment import started
from tests.fleet.netns import Host, network, unavailable
from tests.server.server_harness import REPO, ServerProcess, metric, scrape
from tests.storage.redis_server import RedisServer

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PAGE = 16
NEW = 6
HISTORIES = [f"Conversation {i} keeps its whole history on one host of the fleet. " * 5 for i in range(2)]
HTTP_PORT = 8000  # every host has its own ports: one number for all
EVENTS_PORT = 5557
RENDEZVOUS_PORT = 29500
EVENTS_SETTLE_S = 0.3  # a user's next turn comes later than this: the first turn's pages are published
STARTUP_TRIES = 3  # a start-up slower than the harness's health limit on a loaded machine is waited for again


def complete(url: str, prompt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, Host]]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            made = stack.enter_context(network(["router", "a", "b", "redis", "node0", "node1"]))
        except OSError as exc:
            pytest.skip(f"cannot make network namespaces here: {exc}")
        yield made


@pytest.fixture(scope="module")
def reference() -> Iterator[Callable[[str], str]]:
    """The cache-off single-rank answer to a prompt, computed once per prompt."""
    with Engine(model="tiny", disable_radix_cache=True) as engine:

        @functools.cache
        def answer(prompt: str) -> str:
            return engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0].text

        yield answer


def start(host: Host, logs, name: str, *args: str) -> ServerProcess:
    """`python -m hicache ARGS` on `host`, bound to its address (stopped by pid by the caller)."""
    log = logs / f"{name}.log"
    argv = [sys.executable, "-m", "hicache", "--log-level", "info", *args]
    with open(log, "ab") as out:
        proc = subprocess.Popen(host.command(argv), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return ServerProcess(proc, f"http://{host.address}:{HTTP_PORT}", log)


def wait_healthy(client: Host, server: ServerProcess) -> None:
    """Health as `client` sees it, over the network; a slow start-up (not an exit) is waited for again."""
    for attempt in range(STARTUP_TRIES):
        try:
            client.call(server.wait_healthy)
            return
        except AssertionError:
            if server.proc.poll() is not None or attempt == STARTUP_TRIES - 1:
                raise


@contextlib.contextmanager
def running(client: Host, *servers: ServerProcess) -> Iterator[None]:
    with started(*servers, wait=functools.partial(wait_healthy, client)):
        yield
    for server in servers:  # after a clean run only: a failure's own message is the one to read
        assert "Traceback" not in server.log.read_text(errors="replace"), server.log_tail()


def serve_args(host: Host, *extra: str) -> list[str]:
    return ["serve", "--model", "tiny", "--host", host.address, "--port", str(HTTP_PORT), *extra]


@pytest.fixture(scope="module")
def fleet(hosts, tmp_path_factory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("fleet")
    redis = RedisServer(logs, host=hosts["redis"].address)
    hosts["redis"].call(redis.start)  # a child of a thread in the namespace lives in it
    try:
        servers = []
        for name in ("a", "b"):
            host = hosts[name]
            tiers = ["--enable-hierarchical-cache", "--hicache-storage-backend", "redis",
                     "--hicache-storage-url", redis.url]  # fmt: skip
            events = ["--kv-events-endpoint", f"tcp://{host.address}:{EVENTS_PORT}"]
            servers.append(start(host, logs, name, *serve_args(host, *tiers, *events)))
        with running(hosts["router"], *servers):
            urls = [server.url for server in servers]
            router_host = hosts["router"]
            router = start(router_host, logs, "router", "router", "--policy", "cache-aware",
                           "--server", urls[0], "--server", urls[1], "--startup-timeout", "60",
                           "--host", router_host.address, "--port", str(HTTP_PORT))  # fmt: skip
            with running(router_host, router):
                yield {"router": router.url, "a": urls[0], "b": urls[1]}
    finally:
        redis.close()


def served_by(client: Host, fleet: dict[str, str], prompt: str) -> tuple[dict, str, int]:
    """One request through the router: the response, which server admitted it, its device hit there."""

    def counters() -> dict[str, tuple[float, float]]:
        out = {}
        for name in ("a", "b"):
            samples = scrape(fleet[name])
            out[name] = (metric(samples, "hicache_prompt_tokens_total"),
                         metric(samples, "hicache_cached_tokens_total", tier="device"))  # fmt: skip
        return out

    before = client.call(counters)
    answer = client.call(complete, fleet["router"], prompt)
    after = client.call(counters)
    admitted = [name for name in after if after[name][0] > before[name][0]]
    assert len(admitted) == 1, f"one server serves a request: {before} -> {after}"
    name = admitted[0]
    return answer, name, int(after[name][1] - before[name][1])


def stored_pages(url: str) -> float:
    return metric(scrape(url), "hicache_cache_events_total", event="storage_puts")


def test_the_router_follows_the_prefix_and_the_store_serves_the_other_host(hosts, fleet, reference):
    client = hosts["router"]
    first_hosts = []
    second_turns = []
    for history in HISTORIES:
        answer, name, cached = served_by(client, fleet, history)
        assert answer["choices"][0]["text"] == reference(history)
        assert cached == 0, "a new conversation: nothing of it is cached anywhere"
        first_hosts.append(name)
        second_turns.append(history + answer["choices"][0]["text"] + " And then?")
    assert set(first_hosts) == {"a", "b"}, "nothing cached anywhere: new conversations spread by load"
    time.sleep(EVENTS_SETTLE_S)
    history_pages = len(HISTORIES[0]) // PAGE * PAGE - PAGE  # at least: the last page may be partial
    for prompt, name in zip(second_turns, first_hosts):
        answer, again, cached = served_by(client, fleet, prompt)
        assert again == name, "the second turn goes to the host holding its prefix"
        assert cached >= history_pages, "and hits it there"
        assert answer["choices"][0]["text"] == reference(prompt), "the cache changed no answer"

    # The host that never saw the first conversation reads its prefix from the shared Redis store.
    owner = fleet[first_hosts[0]]
    stranger = fleet["b" if first_hosts[0] == "a" else "a"]
    deadline = time.monotonic() + 30
    while client.call(stored_pages, owner) * PAGE < history_pages and time.monotonic() < deadline:
        time.sleep(0.1)  # the write-through puts run behind the requests
    answer = client.call(complete, stranger, second_turns[0] + " Once more.")
    by_tier = answer["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    assert by_tier["device"] == by_tier["host"] == 0
    assert by_tier["storage"] >= history_pages, by_tier
    assert answer["choices"][0]["text"] == reference(second_turns[0] + " Once more.")


def test_a_tp2_server_with_its_ranks_on_two_hosts(hosts, reference, tmp_path):
    """--nnodes 2: node 0 (the API and rank 0) and node 1 (rank 1) on two hosts, gloo between them."""
    node0, node1 = hosts["node0"], hosts["node1"]
    ranks = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"{node0.address}:{RENDEZVOUS_PORT}"]
    nodes = [
        start(node, tmp_path, f"node{rank}", *serve_args(node, *ranks, "--node-rank", str(rank)))
        for rank, node in enumerate((node0, node1))
    ]
    client = hosts["router"]
    try:
        with running(client, nodes[0]):
            first = client.call(complete, nodes[0].url, HISTORIES[0])
            assert first["choices"][0]["text"] == reference(HISTORIES[0])
            again = HISTORIES[0] + " The same history, a second time."
            second = client.call(complete, nodes[0].url, again)
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(HISTORIES[0]) // PAGE * PAGE - PAGE
            assert second["choices"][0]["text"] == reference(again), "the hit on both ranks changed no answer"
        assert nodes[1].proc.wait(timeout=30) == 0, "node 1's rank leaves when node 0 shuts the job down"
    finally:
        nodes[1].stop()
    assert "Traceback" not in nodes[1].log.read_text(errors="replace"), nodes[1].log_tail()
