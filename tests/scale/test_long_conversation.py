"""One `tiny` conversation that grows past 32K tokens over three turns (issue 22: agent-scale contexts),
through every tier and topology the cache serves it from, answers token for token (and logprob for
logprob) as the cache-off single-rank engine, computed once for the module: with host memory and a file
store, its tail sent to host memory by another user's request and loaded back, then read from the store
after a restart (the last turn sent again); through a P/D pair whose decode server reuses the history it
holds; and with CP2, where each rank's pool holds half the conversation (docs/DESIGN.md, "A cache never
changes an answer").

Each turn adds about 10.6K tokens (a pasted file, a tool's output) and asks for a few; the whole
conversation's compute is about one cold 33K-token prefill per configuration, and the cache-off
reference's under two."""

from __future__ import annotations

import random

import pytest

from hicache import Engine, SamplingParams
from hicache.config import DisaggConfig, EngineConfig, HiCacheConfig, ParallelConfig
from tests.disagg.pd import PDPair, free_ports
from tests.disagg.test_engines import assert_no_leaks, conversations, extend

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PAGE = 16
SYSTEM = 1_000
QUESTION = 10_600
NEW = 4
TURNS = 3
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=1)
LONGEST = SYSTEM + TURNS * QUESTION + (TURNS - 1) * NEW  # the last turn's prompt: 32,808 tokens
CONTEXT = 40_960
# A device pool that holds the last turn and its answer with 29 pages to spare: the conversation and
# anything beside it do not fit together.
POOL = 33_280
# Another user's prompt, longer than what the pool has free beside the conversation's second turn.
OTHER_USER = 11_500


def tiers(store: str) -> HiCacheConfig:
    return HiCacheConfig(enable_hierarchical_cache=True, hicache_load_back_threshold=PAGE,
                         hicache_storage_backend="file", hicache_storage_dir=store,
                         hicache_storage_prefetch_policy="wait_complete")  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    """The conversation's prompts (each carrying the cache-off answers before it) and the cache-off
    results, turn by turn."""
    rng = random.Random(22)
    (history,) = conversations(1, 1, SYSTEM, seed=22)
    extend([history], [[]], rng, qlen=QUESTION)
    prompts, results = [], []
    with Engine(model="tiny", context_length=CONTEXT, max_total_tokens=POOL, disable_radix_cache=True) as engine:
        for _ in range(TURNS):
            prompts.append(list(history))
            (result,) = engine.generate([history], PARAMS)
            results.append(result)
            extend([history], [result.token_ids], rng, qlen=QUESTION)
    assert len(prompts[-1]) == LONGEST > 32_768
    return prompts, results


def assert_same(got, expected, what: str) -> None:
    assert got.error is None, f"{what}: {got.error}"
    assert got.token_ids == expected.token_ids, f"{what}: tokens differ from the cache-off engine"
    assert got.logprobs == expected.logprobs, f"{what}: logprobs differ from the cache-off engine"


def test_host_memory_and_a_file_store_read_after_a_restart_answer_as_the_cache_off_engine(reference, tmp_path):
    """Turn 2 reuses turn 1 from the device; another user's prompt then takes the pages of the
    conversation's tail, which turn 3 loads back from host memory; after a restart, turn 3 sent again
    (a client's retry) reads the whole history from the file store."""
    prompts, expected = reference
    store = str(tmp_path / "store")
    config = EngineConfig(model="tiny", context_length=CONTEXT, max_total_tokens=POOL, hicache=tiers(store))
    with Engine(config) as engine:
        for turn in range(TURNS):
            if turn == TURNS - 1:  # another user's prompt needs pages only the conversation's tail can give
                other = random.Random(7)
                engine.generate([[other.randrange(32, 127) for _ in range(OTHER_USER)]], PARAMS)
            (got,) = engine.generate([prompts[turn]], PARAMS)
            assert_same(got, expected[turn], f"turn {turn}")
            hits = got.cached_tokens_by_tier
            if turn:
                assert got.cached_tokens >= len(prompts[turn - 1]) - PAGE, f"turn {turn} reuses the history: {hits}"
        assert hits["host"] > 0, f"the last turn loads back the tail evicted to host memory: {hits}"
        assert_no_leaks(engine)
    with Engine(config) as restarted:  # the same server after a restart: its memory tiers start empty
        (got,) = restarted.generate([prompts[-1]], PARAMS)
        assert_same(got, expected[-1], "the last turn again, after a restart")
        assert got.cached_tokens_by_tier["storage"] >= LONGEST - PAGE, got.cached_tokens_by_tier
        assert_no_leaks(restarted)


def pd_engine(mode: str, port: int) -> Engine:
    """A prefill server, or a decode server reusing what its tree (device and host memory) holds. Decode
    waits for the KV while prefill computes the whole turn (its first message goes when the prefill
    ends): about 13 s for the last turn on an idle 2-core machine, and it can pass the 60 s default on a
    loaded one."""
    decode = mode == "decode"
    disagg = DisaggConfig(disaggregation_mode=mode, disaggregation_bootstrap_port=port,
                          disaggregation_decode_enable_radix_cache=decode, disaggregation_transfer_timeout=600)
    hicache = HiCacheConfig(enable_hierarchical_cache=decode, hicache_load_back_threshold=PAGE)
    return Engine(EngineConfig(model="tiny", context_length=CONTEXT, max_total_tokens=POOL, hicache=hicache,
                               disagg=disagg))  # fmt: skip


def test_a_pd_pair_with_decode_reuse_sends_only_each_turns_suffix(reference):
    """Each turn after the first, decode serves the history from its own tree (decode_prefix_len grows
    with the conversation), prefill computes only the new tokens, and only those travel."""
    prompts, expected = reference
    port = free_ports(1)
    with pd_engine("decode", port) as decode, pd_engine("prefill", port) as prefill:
        pair = PDPair(prefill, decode, port)
        reused = []
        for turn in range(TURNS):
            (got,) = pair.run([prompts[turn]], PARAMS)
            assert got.prefill.error is None, got.prefill.error
            assert_same(got.decode, expected[turn], f"turn {turn}")
            assert got.transferred_tokens == len(prompts[turn]) - got.decode_prefix_tokens
            reused.append((got.prefill.cached_tokens, got.decode_prefix_tokens))
        assert reused[0] == (0, 0)
        for turn in range(1, TURNS):
            history = len(prompts[turn - 1]) - PAGE
            assert min(reused[turn]) >= history, f"turn {turn}: prefill and decode reuse the history: {reused}"
        assert_no_leaks(prefill, decode)


def test_cp2_with_half_the_conversation_on_each_rank_answers_as_the_cache_off_engine(reference):
    """Also the regression test of CP attention past a key block of context: a block wholly inside the
    cached prefix, or starting after its end, used to fail (hicache/model/attention/gathered.py)."""
    prompts, expected = reference
    per_rank = POOL // 2 + PAGE  # one owner class of the pages: half the conversation and a page to spare
    assert per_rank < LONGEST
    with Engine(model="tiny", context_length=CONTEXT, max_total_tokens=per_rank,
                parallel=ParallelConfig(cp_size=2)) as engine:  # fmt: skip
        for turn in range(TURNS):
            (got,) = engine.generate([prompts[turn]], PARAMS)
            assert_same(got, expected[turn], f"turn {turn}")
            if turn:
                assert got.cached_tokens_by_tier["device"] >= len(prompts[turn - 1]) - PAGE, got.cached_tokens_by_tier
        held = [kv["device"] for kv in engine.kv_bytes_by_rank().values()]
        page_bytes = sum(held) // (engine.pool_usage()["device"][0] // PAGE)
        assert all(abs(h - sum(held) / 2) <= page_bytes for h in held), f"each rank holds half the pages: {held}"
        assert_no_leaks(engine)
