"""Bad input gets an OpenAI-style error object with a 4xx status, never a 5xx; the server keeps serving;
nothing already cached is lost. Runs in process against a real tiny engine (fast), each kind of bad
input by hand, then a few hundred random malformed bodies."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import Engine
from hicache.server.app import create_app
from tests.server.server_harness import ServerProcess

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Long enough for several full pages (tiny's page is 16 byte-tokens).
CACHED_PROMPT = "The cached history must survive every bad request sent after it. " * 2


def assert_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_healthy(client: TestClient) -> None:
    assert client.get("/health").status_code == 200


def completion(client: TestClient, prompt: str) -> dict:
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


BAD_REQUESTS = [
    # (path, raw body, status, param)
    (COMPLETIONS, b"{bad json", 400, None),
    (COMPLETIONS, b"\xff\xfe not utf-8", 400, None),
    (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, None),  # nesting deeper than the parser goes
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", 400, None),
    (COMPLETIONS, b"", 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, b'"a string"', 400, None),
    (COMPLETIONS, json.dumps({"prompt": "x"}).encode(), 400, "model"),
    (COMPLETIONS, json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": 5}).encode(), 400, "prompt"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": [1.5]}).encode(), 400, "prompt"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "10"}).encode(), 400, "max_tokens"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', 400, "top_p"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "seed": 2**64}).encode(), 400, "seed"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "stop": 7}).encode(), 400, "stop"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "stop": ["a"] * 17}).encode(), 400, "stop"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "stop": "a" * 257}).encode(), 400, "stop"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "logprobs": 21}).encode(), 400, "logprobs"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "logprobs": True}).encode(), 400, "logprobs"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "n": 2}).encode(), 400, "n"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "echo": True}).encode(), 400, "echo"),
    (
        COMPLETIONS,
        json.dumps({"model": "tiny", "prompt": "x", "presence_penalty": 0.5}).encode(),
        400,
        "presence_penalty",
    ),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": ["x"] * 65}).encode(), 400, "prompt"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "cache_salt": 1}).encode(), 400, "cache_salt"),
    # Retention hints (docs/DESIGN.md, "retention hints"): a priority is a whole number 0..2**31-1, a
    # retention a finite number of seconds >= 0.
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "priority": -1}).encode(), 400, "priority"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "priority": 2**31}).encode(), 400, "priority"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "priority": "1"}).encode(), 400, "priority"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "priority": 1.5}).encode(), 400, "priority"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "retention_seconds": -1}', 400, "retention_seconds"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "retention_seconds": "9"}', 400, "retention_seconds"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "retention_seconds": Infinity}', 400, "retention_seconds"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "priority": -1}', 400, "priority"),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, None),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": []}).encode(), 400, None),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": [300]}).encode(), 400, None),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": [-1]}).encode(), 400, None),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": ["ok", [1, 999]]}).encode(), 400, None),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode(), 400, None),  # > context 4096
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 10**6}).encode(), 400, None),
    (COMPLETIONS, json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2**70}).encode(), 400, None),
    (COMPLETIONS, json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model"),
    (CHAT, json.dumps({"model": "tiny"}).encode(), 400, "messages"),
    (CHAT, json.dumps({"model": "tiny", "messages": []}).encode(), 400, "messages"),
    (CHAT, json.dumps({"model": "tiny", "messages": "hi"}).encode(), 400, "messages"),
    (CHAT, json.dumps({"model": "tiny", "messages": [{"content": "hi"}]}).encode(), 400, "messages"),
    (
        CHAT,
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
        400,
        "messages",
    ),
    (
        CHAT,
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}).encode(),
        400,
        None,
    ),
    (CHAT, json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}).encode(), 400, None),
    (
        CHAT,
        json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
        ).encode(),
        400,
        "tools",
    ),
    (
        CHAT,
        json.dumps(
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"},
            }
        ).encode(),
        400,
        "response_format",
    ),
    (
        CHAT,
        json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}
        ).encode(),
        400,
        None,
    ),
    (CHAT, json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_each_kind_of_bad_input(app_client: TestClient, path: str, body: bytes, status: int, param: str | None) -> None:
    error = assert_error(app_client.post(path, content=body, headers={"content-type": "application/json"}), status)
    if param is not None:
        assert error["param"] == param
    assert_healthy(app_client)


def test_wrong_method_and_unknown_route_are_error_objects(app_client: TestClient) -> None:
    assert_error(app_client.get(COMPLETIONS), 405)
    assert_error(app_client.get("/v2/nothing"), 404)


def test_tiny_temperature_is_greedy_not_a_crash(app_client: TestClient) -> None:
    # 1e-300 would overflow the scaled logits to inf inside the scheduler: the server makes it greedy.
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 8}
    greedy = app_client.post(COMPLETIONS, json={**body, "temperature": 0}).json()["choices"][0]["text"]
    tiny = app_client.post(COMPLETIONS, json={**body, "temperature": 1e-300})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy


def test_api_key(app_client: TestClient) -> None:
    engine = app_client.app.state.engine_client.engine  # type: ignore[attr-defined]
    # No `with`: no lifespan, so this second app leaves the shared engine running.
    client = TestClient(create_app(engine, "tiny", api_key="sesame"), raise_server_exceptions=False)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    assert_error(client.post(COMPLETIONS, json=body), 401)
    assert_error(client.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.post(COMPLETIONS, content=b"{bad", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.post("/flush_cache"), 401)
    assert client.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert client.get("/health").status_code == 200  # probes need no key


# ---- random malformed bodies ------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
# Sometimes the right type, mostly not; ints kept small so a body that happens to be valid stays fast.
small_ints = st.sampled_from([-1, 0, 1, 2, 5, 16, 10**6, 2**64])
plausible = {
    "model": st.sampled_from(["tiny", "other"]) | json_values,
    "max_tokens": small_ints | json_values,
    "max_completion_tokens": small_ints | json_values,
    "temperature": st.floats() | json_values,
    "top_p": st.floats() | json_values,
    "top_k": small_ints | json_values,
    "seed": st.integers() | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "logprobs": small_ints | st.booleans() | json_values,
    "top_logprobs": small_ints | json_values,
    "n": small_ints | json_values,
    "user": st.text(max_size=5) | json_values,
    "cache_salt": st.text(max_size=5) | json_values,
    "ignore_eos": st.booleans() | json_values,
}
prompts = st.text(max_size=30) | st.lists(st.integers(-5, 300), max_size=8) | st.lists(st.text(max_size=5), max_size=3)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.sampled_from(["user", "system", "assistant"]) | json_values,
                "content": st.text(max_size=20) | json_values,
            },
        ),
        max_size=3,
    )
    | json_values
)


def bodies(base: dict, main_field: str, main: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid body with up to three fields replaced or removed, so that the fuzzing reaches past
    the first field validated (and some bodies are valid and generate); sometimes any JSON at all."""
    fields = {main_field: main | json_values, **plausible}
    overrides = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys})
    )
    removed = st.sets(st.sampled_from(sorted(base)), max_size=1)
    mutated = st.builds(lambda o, r: {k: v for k, v in {**base, **o}.items() if k not in r}, overrides, removed)
    return st.one_of(mutated, mutated, mutated, json_values)


FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def check_no_5xx(client: TestClient, path: str, body: object) -> None:
    r = client.post(path, content=json.dumps(body).encode())
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert_error(r, r.status_code)
    assert_healthy(client)


@pytest.mark.slow
@FUZZ
@given(body=bodies({"model": "tiny", "prompt": "hi", "max_tokens": 4}, "prompt", prompts))
def test_random_completion_bodies(app_client: TestClient, body: object) -> None:
    check_no_5xx(app_client, COMPLETIONS, body)


@pytest.mark.slow
@FUZZ
@given(
    body=bodies(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "messages", messages
    )
)
def test_random_chat_bodies(app_client: TestClient, body: object) -> None:
    check_no_5xx(app_client, CHAT, body)


def test_cache_survives_bad_requests(app_client: TestClient) -> None:
    """Runs after the fuzzing above (file order): the first prompt is cached before any bad request of
    this test, and must come back from cache with the same answer after them."""
    first = completion(app_client, CACHED_PROMPT)
    for path, body, status, _ in BAD_REQUESTS:
        assert app_client.post(path, content=body).status_code == status
    again = completion(app_client, CACHED_PROMPT)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    prompt_tokens = again["usage"]["prompt_tokens"]
    # Every full page before the last prompt token (always recomputed) is served from the cache.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert app_client.post("/flush_cache").status_code == 200
    assert app_client.get("/debug/leaks").json() == []


def test_a_timed_out_request_is_a_504_and_the_server_keeps_serving():
    engine = Engine(model="tiny", request_timeout=0.3, max_total_tokens=8192)
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 3000, "ignore_eos": True}
    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "timeout" and "--request-timeout" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert '"code": "timeout"' in events[-2] and events[-1] == "data: [DONE]"
        assert client.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_a_client_gone_while_sending_its_body_is_not_an_error(server_processes: dict[str, ServerProcess]) -> None:
    """A router cancelling its copy of a request, or a killed curl, leaves a body half sent: the server
    logs a line, not a traceback, and keeps serving."""
    server = server_processes["cache"]
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(
                f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                'Content-Length: 1000\r\n\r\n{"model": "tiny", "prompt": '.encode()
            )
    deadline = time.monotonic() + 10
    while server.log.read_text().count("client left while sending") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log.read_text()
    assert log.count(f"client left while sending POST {COMPLETIONS}") == 3, server.log_tail()
    assert "Traceback" not in log, server.log_tail()
    r = httpx.post(f"{server.url}{COMPLETIONS}", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
