"""What a client sees of the cache invariant: a multi-turn chat on smollm2, each turn carrying the model's
own earlier answers, returns with the cache on the same tokens and the same top-5 logprobs, bit for
bit, as a --disable-radix-cache server; from the device tier, from host memory (two conversations
take turns on a device pool too small for both), and from storage after a restart. The servers are
real `hicache serve` processes and the client is the official `openai` package."""

from __future__ import annotations

import pathlib

import httpx
import pytest
from openai import OpenAI

from tests.server.server_harness import assert_no_leaks, running_servers

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

SYSTEM = "You are a terse assistant for a travel agency; answer in one sentence. " * 12
CONVERSATIONS = {
    "ana": ["Where is Lisbon?", "What river runs through it?", "Name a dish from there."],
    "ben": ["Where is Vienna?", "What is it famous for?", "Name a composer from there."],
}
MAX_TOKENS = 24
SMOLLM2 = ("--model", "smollm2")
# The two conversations' histories (~220 tokens each at the first turn, ~300 at the last) do not both
# fit in 512 device tokens after the first turn: a turn of one evicts the other, whose next turn comes
# back from host memory.
HIERARCHICAL = ("--enable-hierarchical-cache", "--max-total-tokens", "512", "--hicache-ratio", "8")


def converse(url: str) -> list[tuple[str, list, dict]]:
    """Both conversations, turn by turn, interleaved; per turn: the answer, its per-token logprobs
    (token, logprob, top-5 (token, logprob)), and the cached tokens by tier."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    histories = {name: [{"role": "system", "content": f"The traveller is {name}. " + SYSTEM}] for name in CONVERSATIONS}
    turns = []
    for i in range(len(CONVERSATIONS["ana"])):
        for name, questions in CONVERSATIONS.items():
            histories[name].append({"role": "user", "content": questions[i]})
            reply = client.chat.completions.create(
                model="smollm2", messages=histories[name], temperature=0, max_tokens=MAX_TOKENS,
                logprobs=True, top_logprobs=5,
            )
            choice = reply.choices[0]
            histories[name].append({"role": "assistant", "content": choice.message.content})
            logprobs = [
                (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in choice.logprobs.content
            ]
            details = reply.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
            turns.append((choice.message.content, logprobs, details))
    return turns


def _assert_same(got: list, expected: list, label: str) -> None:
    for i, ((text, lp, _), (ref_text, ref_lp, _)) in enumerate(zip(got, expected)):
        assert text == ref_text, f"{label}, turn {i}: {text!r} != {ref_text!r}"
        for j, (step, ref) in enumerate(zip(lp, ref_lp)):
            assert step == ref, f"{label}, turn {i}, token {j}: {step} != {ref}"  # floats compared exactly


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list:
    with running_servers(tmp_path_factory.mktemp("ref"), (*SMOLLM2, "--disable-radix-cache")) as (server,):
        turns = converse(server.url)
    assert all(sum(tiers.values()) == 0 for _, _, tiers in turns)
    return turns


def test_host_and_storage_tiers_answers_and_logprobs_equal_cache_off(reference: list, tmp_path: pathlib.Path) -> None:
    # A low prefetch threshold: the first turns' prompts (~220 tokens) are below the default 256.
    store = ("--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path / "store"),
             "--hicache-storage-prefetch-threshold", "64")
    with running_servers(tmp_path, (*SMOLLM2, *HIERARCHICAL, *store)) as (server,):
        assert httpx.get(f"{server.url}/health").json()["batch_invariance"]["verified"] is True
        turns = converse(server.url)
        assert_no_leaks(server.url)
    # Each conversation's later turns find part of their history on the device, the part the other's
    # turn pushed out in host memory.
    assert any(tiers["device"] > 0 for _, _, tiers in turns), f"no device hit: {[t for _, _, t in turns]}"
    assert any(tiers["host"] > 0 for _, _, tiers in turns), f"no host hit: {[t for _, _, t in turns]}"
    _assert_same(turns, reference, "device + host")
    # A new server on the same store: every turn's history comes back from storage.
    with running_servers(tmp_path, (*SMOLLM2, *HIERARCHICAL, *store)) as (server,):
        restarted = converse(server.url)
        assert_no_leaks(server.url)
    assert any(tiers["storage"] > 0 for _, _, tiers in restarted), f"no storage hit: {[t for _, _, t in restarted]}"
    _assert_same(restarted, reference, "storage after a restart")
