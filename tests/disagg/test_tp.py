"""Prefill-decode at tensor parallel size 2 on both sides: rank r of prefill sends its KV heads to rank
r of decode, the ranks agree on every transfer's outcome, and what the router returns equals a
cache-off server at the same TP size. A single-rank prefill feeds the TP2 decode too, each decode rank
taking its KV heads from it (docs/DESIGN.md, "P/D across topologies")."""

from __future__ import annotations

import pytest

from tests.disagg.deployment import (
    DECODE_REUSE,
    complete,
    decode_counters,
    ports,
    prefill_args,
    router,
    serve,
    started,
)
from tests.disagg.pd import free_ports
from tests.server.server_harness import assert_no_leaks

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

TP2 = ("--tp-size", "2")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("pd-tp")
    p_port, d_port, ref_port, p1_port, r_port = ports(5)
    boot, boot1 = free_ports(2), free_ports(1)
    servers = {
        "prefill": serve(logs, p_port, *TP2, *prefill_args(boot)),
        "decode": serve(logs, d_port, *TP2, *DECODE_REUSE),
        "ref": serve(logs, ref_port, *TP2, "--disable-radix-cache"),
        "prefill_tp1": serve(logs, p1_port, *prefill_args(boot1)),
    }
    with started(*servers.values()):
        front = router(logs, r_port, [servers["prefill"].url], [servers["decode"].url])
        with started(front):
            yield {"router": front.url, **{name: s.url for name, s in servers.items()}}


def test_tp2_prefill_and_tp2_decode_equal_a_tp2_cache_off_server(deployment):
    front, ref, decode = deployment["router"], deployment["ref"], deployment["decode"]
    history = list(range(40, 140)) * 2
    for turn in range(3):
        before = decode_counters(decode)
        got = complete(front, history)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == complete(ref, history).json()["choices"][0]["text"], f"turn {turn}"
        details = got.json()["usage"]["prompt_tokens_details"]
        after = decode_counters(decode)
        assert after["received"] - before["received"] == len(history) - details["decode_prefix_tokens"]
        if turn:
            assert details["decode_prefix_tokens"] > 0, "decode's ranks reuse their shards of the tree"
        history += list(range(50 + turn, 100 + turn))
    for name in ("prefill", "decode"):
        assert_no_leaks(deployment[name])


def test_a_tp1_prefill_feeds_the_tp2_decode(deployment, tmp_path):
    front = router(tmp_path, ports(1)[0], [deployment["prefill_tp1"]], [deployment["decode"]])
    with started(front):
        history = list(range(60, 160)) * 2  # not the other test's conversation: decode receives it all
        for turn in range(2):
            got = complete(front.url, history, logprobs=2)
            assert got.status_code == 200, got.text
            want = complete(deployment["ref"], history, logprobs=2).json()["choices"][0]["logprobs"]
            assert got.json()["choices"][0]["logprobs"] == want, f"turn {turn}"
            history += list(range(70 + turn, 110 + turn))
