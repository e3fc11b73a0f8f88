"""What a client sees of speculative decoding: a `hicache serve` with a draft (packed or sidecar, on
all three tiers) streams the same tokens and logprobs, bit for bit, as a cache-off server without one, from the
device, from host memory and from storage after a flush; the usage of each answer carries the draft's
proposed and accepted tokens, and /metrics their totals."""

from __future__ import annotations

import json
import pathlib

import httpx
import pytest

from tests.server.server_harness import assert_no_leaks, metric, running_servers, scrape

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

# Three histories, two of which fit in the device pool: each round evicts one to host memory.
HISTORIES = [[40 + (i * 7 + j * 3) % 80 for j in range(200)] for i in range(3)]
MAX_TOKENS = 12


def spec_flags(draft: str) -> tuple[str, ...]:
    return ("--speculative-algorithm", "draft", "--speculative-draft-model", draft,
            "--speculative-num-draft-tokens", "3")  # fmt: skip


def stream(url: str, prompt: list[int]) -> tuple[list, dict, dict]:
    """One streamed greedy completion: its (token, logprob, top-2) per token, the final usage and the
    cached tokens by tier."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, usage = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                lp = choice.get("logprobs") or {}
                for token, logprob, top in zip(lp.get("tokens", []), lp.get("token_logprobs", []),
                                               lp.get("top_logprobs", [])):  # fmt: skip
                    tokens.append((token, logprob, sorted(top.items())))
    assert usage is not None
    return tokens, usage, usage["prompt_tokens_details"]["cached_tokens_by_tier"]


@pytest.mark.parametrize("draft", ["tiny-draft-packed", "tiny-draft-sidecar"])
def test_streamed_answers_equal_the_target_alone_on_every_tier(tmp_path: pathlib.Path, draft: str) -> None:
    store = str(tmp_path / "store")
    tiers = ("--enable-hierarchical-cache", "--max-total-tokens", "512", "--hicache-storage-backend", "file",
             "--hicache-storage-dir", store, "--hicache-storage-prefetch-threshold", "16")  # fmt: skip
    with running_servers(tmp_path, ("--disable-radix-cache",), (*tiers, *spec_flags(draft))) as (plain, spec):
        served = {"device": 0, "host": 0, "storage": 0}
        proposed = accepted = 0
        # The last history again (device), the first two (evicted meanwhile: host), all after a flush (storage).
        for round_, order in enumerate(([0, 1, 2], [2, 0, 1], [0, 1, 2])):
            if round_ == 2:
                assert httpx.post(f"{spec.url}/flush_cache").status_code == 200
            for i in order:
                prompt = HISTORIES[i] + [33 + round_]
                want, plain_usage, _ = stream(plain.url, prompt)
                got, usage, by_tier = stream(spec.url, prompt)
                assert got == want, f"round {round_}, history {i}: speculation changed the answer"
                assert "completion_tokens_details" not in plain_usage
                details = usage["completion_tokens_details"]
                assert 0 <= details["spec_accepted_tokens"] <= details["spec_proposed_tokens"]
                proposed += details["spec_proposed_tokens"]
                accepted += details["spec_accepted_tokens"]
                for tier, n in by_tier.items():
                    served[tier] += n
        assert all(n > 0 for n in served.values()), served
        samples = scrape(spec.url)
        assert metric(samples, "hicache_spec_proposed_tokens_total") == proposed > 0
        assert metric(samples, "hicache_spec_accepted_tokens_total") == accepted > 0
        assert metric(samples, "hicache_spec_draft_recomputed_tokens_total") == 0
        assert metric(samples, "hicache_prefetch_lost_pages_total", reason="draft_missing") == 0
        assert ("hicache_spec_proposed_tokens_total", ()) not in scrape(plain.url)
        assert_no_leaks(spec.url)
