"""P/D across topologies (docs/DESIGN.md, "P/D across topologies"), through `hicache router` in front of
real servers: a prefill server at PP2 (the Astron shape), TP2 or CP2 sends a single-rank decode server
the cells each of its ranks holds (under CP, of the pages each rank owns). Turn after turn of two
interleaved conversations, the tokens and logprobs equal a single-rank cache-off server's, decode's
reuse still works (later turns receive only the suffix after decode_prefix_len, counted by decode's
metrics), and prefill sends exactly the bytes decode receives (no page crosses twice)."""

from __future__ import annotations

import pytest

from tests.disagg.deployment import DECODE_REUSE, complete, decode_counters, ports, prefill_args, router, serve, started
from tests.disagg.pd import free_ports
from tests.server.server_harness import assert_no_leaks, metric, scrape

PAGE = 16


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """One decode server (TP1, with reuse) and the reference, shared by the prefill layouts below."""
    logs = tmp_path_factory.mktemp("pd-topologies")
    d_port, ref_port = ports(2)
    decode = serve(logs, d_port, *DECODE_REUSE)
    ref = serve(logs, ref_port, "--disable-radix-cache")
    with started(decode, ref):
        yield {"logs": logs, "decode": decode.url, "ref": ref.url}


def sent_bytes(prefill: str) -> float:
    return metric(scrape(prefill), "hicache_disagg_sent_bytes_total")


@pytest.mark.parametrize(
    "layout", [("--pp-size", "2"), ("--tp-size", "2"), ("--cp-size", "2")], ids=["pp2", "tp2", "cp2"]
)
def test_a_prefill_of_another_layout_feeds_a_tp1_decode_and_equals_one_cache_off_server(servers, layout):
    decode, ref = servers["decode"], servers["ref"]
    p_port, r_port = ports(2)
    prefill = serve(servers["logs"], p_port, *layout, *prefill_args(free_ports(2)))
    with started(prefill):
        front = router(servers["logs"], r_port, [prefill.url], [decode])
        with started(front):
            # Each layout its own conversations, so a first turn finds nothing on decode; two of them,
            # interleaved, so a turn's prefix on decode is not simply the last request's.
            histories = [[(7 * i + len(layout[0]) * 31 + 11 * c) % 250 for i in range(150)] for c in range(2)]
            previous = [0, 0]  # each conversation's last prompt length, which decode's tree holds
            for turn in range(3):
                for c, history in enumerate(histories):
                    before, sent = decode_counters(decode), sent_bytes(prefill.url)
                    got = complete(front.url, history, max_tokens=8, logprobs=2)
                    assert got.status_code == 200, got.text
                    want = complete(ref, history, max_tokens=8, logprobs=2).json()["choices"][0]
                    assert got.json()["choices"][0]["logprobs"] == want["logprobs"], f"turn {turn}, conversation {c}"
                    reused = got.json()["usage"]["prompt_tokens_details"]["decode_prefix_tokens"]
                    after = decode_counters(decode)
                    received = after["received"] - before["received"]
                    assert received == len(history) - reused, "decode receives exactly the prompt after its prefix"
                    assert reused >= previous[c] // PAGE * PAGE, "a later turn receives only what follows the last"
                    # Every cell of every page crosses once: from its one owner under CP, not from each rank.
                    assert after["bytes"] - before["bytes"] == sent_bytes(prefill.url) - sent > 0
                    previous[c] = len(history)
                    histories[c] = history + [40 + turn + c] * 40  # the next turn
        assert_no_leaks(prefill.url)
    assert_no_leaks(decode)
