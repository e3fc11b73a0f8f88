"""Speculative decoding with P/D disaggregation (docs/DESIGN.md, "Speculation x P/D"): a prefill server and a
decode server run the same draft, and each transfer moves the draft's rows (an MTP head's carry the target's
hidden states) with the target's. Over three turns of four conversations, with decode reuse and a host tier
on decode, greedy outputs equal the single-rank cache-off target's token for token, acceptance equals the
single-rank speculative run's, decode recomputes none of the draft's prefix, and only the suffix after
decode_prefix_len crosses: exactly its tokens' bytes of both models' rows. `tiny-mtp` runs between two
in-process engines; the Astron shape, prefill PP2 (host and file storage) to decode PP1 through `hicache
router` over four turns, runs the MTP head as the seed's deployment does (the separate draft's rows cross
P/D in the across-topologies cases, PP2 to PP2 among them). The negative control moves the target's rows alone (`--debug-skip-draft-restore` on both
servers): outputs stay, the MTP head's acceptance changes, since the hidden states it reads never arrived."""

from __future__ import annotations

import random
from collections.abc import Sequence

import httpx
import pytest

from hicache import Engine, SamplingParams
from hicache.config import DebugConfig, DisaggConfig, EngineConfig, HiCacheConfig, ParallelConfig
from hicache.disagg.handshake import Handshake
from hicache.engine.engine import GenerationResult
from hicache.model.loading.loader import load_model
from tests.conversations import run_turns
from tests.disagg.deployment import DECODE_REUSE, complete, decode_counters, ports, prefill_args, router, serve, started
from tests.disagg.pd import PDPair, Turn, free_ports
from tests.parallel.workload import tokens
from tests.server.server_harness import assert_no_leaks
from tests.spec.workload import CONVS, DEVICE_TOKENS, NEW, TURNS, K, acceptance, assert_clean, spec

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PAGE = 16
MTP = "tiny-mtp"
DRAFT_LAYERS = {MTP: 1, "tiny-draft-packed": 3}


class PDFront:
    """A prefill-decode pair behind `Engine.generate`'s shape, so `run_turns` drives it as it drives one
    engine: both halves of every prompt submitted at once, the answer decode's. Keeps every turn."""

    def __init__(self, pair: PDPair) -> None:
        self.pair = pair
        self.turns: list[list[Turn]] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, cache_salt: str = "") -> list:
        assert not cache_salt
        turns = self.pair.run(prompts, params)
        self.turns.append(turns)
        results: list[GenerationResult] = [t.decode for t in turns]
        assert all(r.error is None for r in results), [r.error for r in results]
        return results


def pd_engines(
    draft: str, debug: DebugConfig, prefill_parallel: ParallelConfig | None = None,
    decode_parallel: ParallelConfig | None = None,
) -> tuple[Engine, Engine, int]:  # fmt: skip
    prefill_parallel, decode_parallel = prefill_parallel or ParallelConfig(), decode_parallel or ParallelConfig()
    port = free_ports(prefill_parallel.world_size)
    d = DisaggConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
    prefill = Engine(EngineConfig(model="tiny", disagg=d, speculative=spec(draft), debug=debug,
                                  parallel=prefill_parallel))  # fmt: skip
    # Decode's device pool holds about a third of the working set: later turns come back from its host tier.
    decode = Engine(
        EngineConfig(
            model="tiny",
            max_total_tokens=DEVICE_TOKENS,
            hicache=HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_load_back_threshold=16),
            disagg=DisaggConfig(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True),
            speculative=spec(draft),
            debug=debug,
            parallel=decode_parallel,
        )
    )
    return prefill, decode, port


def row_bytes(engine: Engine) -> int:
    """One token's bytes a transfer moves (the target's rows and the draft's)."""
    return Handshake.from_json(engine.disagg_info()["handshake"]).row_bytes


def row_bytes_without_draft(engine: Engine) -> int:
    """The same, less the draft's rows."""
    hs = Handshake.from_json(engine.disagg_info()["handshake"])
    return Handshake.from_json({**hs.to_json(), "draft_layers": 0, "draft_kv_layout": ()}).row_bytes


@pytest.fixture(scope="module")
def mtp_pd():
    """A P/D pair running the MTP head over the workload, once: the engines, each turn's pairs, the results."""
    prefill, decode, port = pd_engines(MTP, DebugConfig())
    with prefill, decode:
        front = PDFront(PDPair(prefill, decode, port))
        turns = run_turns(front, CONVS, TURNS, NEW)
        yield prefill, decode, front.turns, turns


def test_pd_with_an_mtp_head_equals_the_single_rank_run_and_moves_only_the_suffix(
    reference, cache_off_acceptance, mtp_pd
):
    prefill, decode, pairs_by_turn, turns = mtp_pd
    assert tokens(turns) == reference
    assert acceptance(turns) == cache_off_acceptance[MTP]
    assert decode.spec_stats().draft_recomputed_tokens == 0, "decode took the draft's rows, not recomputed"
    transferred, from_host = 0, 0
    for turn, pairs in enumerate(pairs_by_turn):
        for pair in pairs:
            prompt_len = pair.prefill.prompt_tokens
            assert pair.transferred_tokens == prompt_len - pair.decode_prefix_tokens
            if turn:  # the last turn's prompt is in decode's tree (device or host): only the rest crosses
                assert pair.decode_prefix_tokens >= (prompt_len - NEW - CONVS[0]["qlen"]) // PAGE * PAGE
            transferred += pair.transferred_tokens
            from_host += pair.decode.disagg.decode_prefix_by_tier["host"]
    assert from_host > 0, "some prefix came back from decode's host tier, both models' state with it"
    assert row_bytes(decode) > row_bytes_without_draft(decode), "the handshake counts the draft's rows"
    assert decode.disagg_stats().received_bytes == transferred * row_bytes(decode)
    assert prefill.disagg_stats().sent_bytes == transferred * row_bytes(prefill)
    assert_clean(decode)
    assert_clean(prefill)


def test_without_the_draft_rows_the_heads_acceptance_changes_and_outputs_stay(reference, mtp_pd):
    """The first turn alone, against the same turn with the rows moved."""
    with_rows = mtp_pd[3][:1]
    prefill, decode, port = pd_engines(MTP, DebugConfig(debug_skip_draft_restore=True))
    with prefill, decode:
        first = run_turns(PDFront(PDPair(prefill, decode, port)), CONVS, 1, NEW)
        assert tokens(first) == reference[:1]  # the target verifies every token
        assert acceptance(first) != acceptance(with_rows)
        assert row_bytes(decode) == row_bytes_without_draft(decode), "only the target's rows cross"


# Page-sharded KV on either side: each CP rank of prefill sends the draft's rows of the pages it owns with
# the target's, and a CP rank of decode keeps those of its own pages (its draft pool shards like its target's).
# Two pipelines of one size: each prefill stage sends its decode stage the draft's rows with its layers.
PAIRS = {"cp2-to-tp1": (ParallelConfig(cp_size=2), ParallelConfig()),
         "tp1-to-cp2": (ParallelConfig(), ParallelConfig(cp_size=2)),
         "pp2-to-pp2": (ParallelConfig(pp_size=2), ParallelConfig(pp_size=2))}  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("topologies", PAIRS)
def test_pd_across_topologies_moves_the_drafts_rows_from_their_holders(
    reference, cache_off_acceptance, topologies
):
    draft = "tiny-draft-packed"
    prefill_parallel, decode_parallel = PAIRS[topologies]
    prefill, decode, port = pd_engines(draft, DebugConfig(), prefill_parallel, decode_parallel)
    with prefill, decode:
        front = PDFront(PDPair(prefill, decode, port))
        turns = run_turns(front, CONVS, TURNS, NEW)
        assert tokens(turns) == reference
        assert acceptance(turns) == cache_off_acceptance[draft]
        assert decode.spec_stats().draft_recomputed_tokens == 0, "decode took the draft's rows, not recomputed"
        pairs = [pair for turn in front.turns for pair in turn]
        assert all(p.transferred_tokens == p.prefill.prompt_tokens - p.decode_prefix_tokens for p in pairs)
        assert any(p.decode_prefix_tokens for p in front.turns[-1]), "later turns reuse decode's prefix"
        sent, transferred = prefill.disagg_stats().sent_bytes, sum(p.transferred_tokens for p in pairs)
        assert sent == decode.disagg_stats().received_bytes
        if prefill_parallel.pp_size == 1:  # one row shape on every rank: each page once, from its owner, except
            # that an unsharded prefill sends every decode CP rank every page, each keeping its own (docs/DESIGN.md,
            # "P/D across topologies")
            assert sent == transferred * row_bytes(prefill) * decode_parallel.cp_size
        assert_clean(decode)
        assert_clean(prefill)


def test_the_astron_shape_through_the_router(four_turn_reference, four_turn_acceptance, tmp_path):
    """The seed's Astron deployment: prefill at PP2 with host memory and a file store, decode at PP1 with
    decode reuse and a host tier, both running the MTP head (its rows come from prefill's last stage with
    the target's hidden states), `hicache router` in front. Each
    turn's prompts are the reference run's (its outputs appended), four turns, so every answer is compared
    with the single-rank cache-off target's; later turns receive only what follows decode's prefix."""
    draft = MTP
    flags = ("--speculative-algorithm", "draft", "--speculative-draft-model", draft,
             "--speculative-num-draft-tokens", str(K))  # fmt: skip
    p_port, d_port, r_port = ports(3)
    text_of = load_model("tiny").tokenizer.decode
    # One server starts at a time: on a loaded 2-core machine, three processes' self-checks at once can
    # outlast a server's start-up deadline.
    # Its host tier holds four turns of the working set (~3x its device pool): later turns reuse all of it.
    decode = serve(tmp_path, d_port, *DECODE_REUSE, "--max-total-tokens", str(DEVICE_TOKENS), "--hicache-ratio", "4",
                   "--hicache-load-back-threshold", "16", *flags)  # fmt: skip
    with started(decode):
        prefill = serve(tmp_path, p_port, "--pp-size", "2", "--enable-hierarchical-cache", "--hicache-storage-backend",
                        "file", "--hicache-storage-dir", str(tmp_path / "store"), *flags,
                        *prefill_args(free_ports(2)))  # fmt: skip
        with started(prefill):
            front = router(tmp_path, r_port, [prefill.url], [decode.url])
            with started(front):
                proposed, accepted, from_host = run_reference_turns(front.url, decode.url, four_turn_reference,
                                                                    text_of, DRAFT_LAYERS[draft])  # fmt: skip
            assert (proposed, accepted) == four_turn_acceptance[draft]
            assert from_host > 0, "some of decode's prefix came back from its host tier"
            assert_no_leaks(prefill.url)
        assert_no_leaks(decode.url)


def run_reference_turns(url: str, decode_url: str, reference, text_of, draft_layers: int) -> tuple[int, int, int]:
    """The reference run's turns through the router at `url`, each answer checked against the reference's
    tokens and each transfer against decode's prefix; returns (proposed, accepted, decode prefix tokens
    from its host tier)."""
    handshake = Handshake.from_json(httpx.get(f"{decode_url}/disagg/info", timeout=10).json()["handshake"])
    assert handshake.draft_layers == draft_layers, "decode takes the draft's layers with the target's"
    row_bytes = handshake.row_bytes
    histories = [list(c["system"]) for c in CONVS]
    rngs = [random.Random(c["seed"]) for c in CONVS]
    proposed = accepted = from_host = 0
    for turn, outputs in enumerate(reference):
        for history, conv, rng, want in zip(histories, CONVS, rngs, outputs):
            history.extend(rng.randrange(32, 127) for _ in range(conv["qlen"]))  # as run_turns does
            before = decode_counters(decode_url)
            got = complete(url, history, max_tokens=NEW, logprobs=1)
            assert got.status_code == 200, got.text
            body = got.json()
            assert body["choices"][0]["logprobs"]["tokens"] == [text_of([t]) for t in want], f"turn {turn}"
            usage = body["usage"]
            reused = usage["prompt_tokens_details"]["decode_prefix_tokens"]
            counters = decode_counters(decode_url)
            assert counters["received"] - before["received"] == len(history) - reused
            assert counters["bytes"] - before["bytes"] == (len(history) - reused) * row_bytes, "both models' rows"
            if turn:  # the last turn's prompt and answer are in decode's tree (device or host)
                assert reused >= (len(history) - conv["qlen"]) // PAGE * PAGE
            from_host += counters["host"] - before["host"]
            proposed += usage["completion_tokens_details"]["spec_proposed_tokens"]
            accepted += usage["completion_tokens_details"]["spec_accepted_tokens"]
            history.extend(want)
    return proposed, accepted, from_host
