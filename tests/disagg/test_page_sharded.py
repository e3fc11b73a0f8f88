"""P/D with page-sharded KV on decode's side or of MLA (docs/DESIGN.md, "P/D across topologies": page
ownership as a cut), through `hicache router` in front of real servers. An MLA model at TP2 shards its
latent pages over its TP ranks, as CP does: its prefill feeds a TP1 decode. A CP2 decode takes, on each
rank, the pages it owns, from a CP2 prefill and from a TP1 one. Turn after turn, the tokens and logprobs
equal a single-rank cache-off server's, and only the suffix after decode's prefix crosses. To keep at
most four rank processes at once, the CP2 decode's reference answers before the CP2 prefill starts.
With a speculative draft: tests/spec/test_spec_pd.py."""

from __future__ import annotations

import pathlib

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


def recorded(logs: pathlib.Path, prompts: list[tuple[int, list[int]]]) -> dict[tuple[int, ...], object]:
    """The tokens and logprobs of a single-rank cache-off server for each prompt, by prompt."""
    (port,) = ports(1)
    ref = serve(logs, port, "--disable-radix-cache")
    with started(ref):
        return {tuple(p): reference(ref.url)(p) for _, p in prompts}


def test_an_mla_prefill_at_tp2_feeds_a_tp1_decode(tmp_path):
    mla = ("--model", "tiny-mla")
    p_port, d_port, ref_port, r_port = ports(4)
    prefill = serve(tmp_path, p_port, *mla, "--tp-size", "2", *prefill_args(free_ports(2)))
    decode = serve(tmp_path, d_port, *mla, *DECODE_REUSE)
    ref = serve(tmp_path, ref_port, *mla, "--disable-radix-cache")
    with started(prefill, decode, ref):  # four rank processes
        front = router(tmp_path, r_port, [prefill.url], [decode.url])
        with started(front):
            prompts = conversations(seed=4, count=1)
            check_turns(front.url, prefill.url, decode.url, prompts, reference(ref.url, "tiny-mla"), model="tiny-mla")
        assert_no_leaks(prefill.url)
        assert_no_leaks(decode.url)


def test_a_cp2_decode_takes_its_own_pages_from_a_cp2_and_a_tp1_prefill(tmp_path):
    first, second = conversations(seed=5, count=1), conversations(seed=6, count=1, turns=2)
    p_port, d_port, r_port, p1_port, r1_port = ports(5)
    decode = serve(tmp_path, d_port, "--cp-size", "2", *DECODE_REUSE)  # starts while the reference answers
    want = recorded(tmp_path, first + second)
    with started(decode):
        for port, front_port, layout, prompts in ((p_port, r_port, ("--cp-size", "2"), first),
                                                  (p1_port, r1_port, (), second)):  # fmt: skip
            prefill = serve(tmp_path, port, *layout, *prefill_args(free_ports(2)))
            with started(prefill):
                front = router(tmp_path, front_port, [prefill.url], [decode.url])
                with started(front):
                    check_turns(front.url, prefill.url, decode.url, prompts, lambda p: want[tuple(p)])
                assert_no_leaks(prefill.url)
        assert_no_leaks(decode.url)
