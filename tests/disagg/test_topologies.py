"""P/D across topologies (docs/DESIGN.md, "P/D across topologies"), through `hicache router` in front of
real servers: a prefill server at PP2 (the Astron shape), TP2 or CP2 sends a single-rank decode server
the cells each of its ranks holds (under CP, of the pages each rank owns). Turn after turn of two
interleaved conversations, the tokens and logprobs equal a single-rank cache-off server's, decode's
reuse still works (later turns receive only the suffix after decode_prefix_len, counted by decode's
metrics), and prefill sends exactly the bytes decode receives (no page crosses twice)."""

from __future__ import annotations

import pytest

from tests.disagg.deployment import (
    DECODE_REUSE,
    check_turns,
    conversations,
    ports,
    prefill_args,
    reference,
    router,
    serve,
    started,
)
from tests.disagg.pd import free_ports
from tests.server.server_harness import assert_no_leaks

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """One decode server (TP1, with reuse) and the reference, shared by the prefill layouts below."""
    logs = tmp_path_factory.mktemp("pd-topologies")
    d_port, ref_port = ports(2)
    decode = serve(logs, d_port, *DECODE_REUSE)
    ref = serve(logs, ref_port, "--disable-radix-cache")
    with started(decode, ref):
        yield {"logs": logs, "decode": decode.url, "ref": ref.url}


@pytest.mark.parametrize(
    "seed,layout",
    [(1, ("--pp-size", "2")), (2, ("--tp-size", "2")), (3, ("--cp-size", "2"))],
    ids=["pp2", "tp2", "cp2"],
)
def test_a_prefill_of_another_layout_feeds_a_tp1_decode_and_equals_one_cache_off_server(servers, seed, layout):
    decode, ref = servers["decode"], servers["ref"]
    p_port, r_port = ports(2)
    prefill = serve(servers["logs"], p_port, *layout, *prefill_args(free_ports(2)))
    with started(prefill):
        front = router(servers["logs"], r_port, [prefill.url], [decode])
        with started(front):
            # Each layout its own conversations (`seed`), so a first turn finds nothing on decode.
            check_turns(front.url, prefill.url, decode, conversations(seed), reference(ref))
        assert_no_leaks(prefill.url)
    assert_no_leaks(decode)
