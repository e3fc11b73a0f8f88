"""A server whose host -> device loads fail now and then (--debug-load-fail-rate) keeps its device
capacity: agents in groups sharing a system prompt, concurrent through the official `openai` client,
get their answers, and after a flush no device page is held (hicache_pool_used_tokens)."""

from __future__ import annotations

import pathlib
import random

import openai
import pytest

from tests.server.server_harness import assert_no_leaks, metric, running_servers, scrape

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

GROUPS, PER_GROUP, TURNS = 4, 4, 4
# A device pool smaller than the agents' histories, so turns load them back from host memory; two loads in
# five fail.
ARGS = ("--enable-hierarchical-cache", "--max-total-tokens", "3072", "--hicache-ratio", "2",
        "--debug-load-fail-rate", "0.4")  # fmt: skip


def text(rng: random.Random, n: int) -> str:
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))  # one byte, one token of tiny


def agents(url: str) -> None:
    """Every agent's next turn in one batch request (as a fleet stepping together sends it), turn by turn."""
    rng = random.Random(0)
    systems = [text(rng, 300) for _ in range(GROUPS)]
    histories = [system for system in systems for _ in range(PER_GROUP)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    for _ in range(TURNS):
        histories = [h + text(rng, 40) for h in histories]
        replies = client.completions.create(
            model="tiny", prompt=histories, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}
        )
        answers = sorted(replies.choices, key=lambda c: c.index)
        assert all(c.finish_reason == "length" for c in answers)  # the recomputes answered too
        histories = [h + c.text for h, c in zip(histories, answers)]


def test_failed_loads_leave_no_device_page_held_after_a_flush(tmp_path: pathlib.Path) -> None:
    with running_servers(tmp_path, ARGS) as (server,):
        agents(server.url)
        assert metric(scrape(server.url), "hicache_cache_events_total", event="load_failed_requests") > 0
        assert_no_leaks(server.url)
