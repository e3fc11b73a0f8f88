"""Prefill-decode through in-process engines and the real ZeroMQ transport (tests/disagg/pd.py): the
invariant (greedy tokens and logprobs through a P/D pair equal one cache-off engine's, turn after
turn, with decode reuse on and off), the transferred tokens (prompt - decode_prefix_len; the whole
prompt without reuse), Figure 5 (docs/DESIGN.md, "P/D decode reuse") end to end, restores of different
requests in flight at once, a cancelled half failing the other cleanly with nothing leaked and every
lock balanced, and the suffix streamed out of prefill's locked pages (docs/DESIGN.md, "P/D streaming"):
with one-page transfer chunks, prompts of 19 and 75 chunks stage at most two chunks in prefill's host
memory, and a decode gone mid-transfer frees the pages prefill kept for it."""

from __future__ import annotations

import random
import time

import pytest

from hicache import Engine, SamplingParams
from hicache.cache.api import RestoreState
from hicache.config import DebugConfig, DisaggConfig, EngineConfig
from hicache.disagg.kv_rows import PoolRows
from tests.disagg.pd import PDPair, decode_engine, free_ports, prefill_engine, scheduler_of

PAGE = 16
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2)
CHUNK_DELAY_MS = 25  # streaming: a 75-chunk transfer takes about 2 s, long enough to cut in the middle


@pytest.fixture(scope="module")
def engines():
    port = free_ports(2)  # and port + 1 for the streaming prefill (a prefill rank r listens on its port + r)
    streaming_port = port + 1
    started = [prefill_engine(port), decode_engine(reuse=True), decode_engine(reuse=False)]
    started.append(Engine(EngineConfig(model="tiny", disable_radix_cache=True)))
    slow_chunks = {"disaggregation_transfer_chunk_pages": 1, "debug_disagg_chunk_delay_ms": CHUNK_DELAY_MS}
    started.append(prefill_engine(streaming_port, **slow_chunks))
    pre, dec, plain, ref, streaming = started
    yield {
        "reuse": PDPair(pre, dec, port),
        "plain": PDPair(pre, plain, port),
        "ref": ref,
        "streaming": PDPair(streaming, plain, streaming_port),
    }
    for engine in started:
        engine.shutdown()


def conversations(n_groups: int, per_group: int, system_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32, 127) for _ in range(system_len)] for _ in range(n_groups)]
    return [list(systems[g]) for g in range(n_groups) for _ in range(per_group)]


def extend(histories: list[list[int]], answers: list[list[int]], rng: random.Random, qlen: int = 40) -> None:
    for h, a in zip(histories, answers):
        h.extend(a)
        h.extend(rng.randrange(32, 127) for _ in range(qlen))


def assert_no_leaks(*engines: Engine) -> None:
    for engine in engines:
        deadline = time.monotonic() + 10
        while not engine.flush_cache():  # a prefill gives back the pages its transfer read at its next step
            assert time.monotonic() < deadline, "requests still running, or pages still held"
            time.sleep(0.01)
        assert engine.leak_report() == []


@pytest.mark.slow
@pytest.mark.dtype_sensitive  # a store cap or byte count in the dtype `--dtype auto` takes here
def test_router_style_pairs_equal_one_cache_off_engine_turn_after_turn(engines):
    rng = random.Random(1)
    histories = conversations(2, 2, 200, seed=1)
    extend(histories, [[]] * 4, rng)
    reuse, plain, ref = engines["reuse"], engines["plain"], engines["ref"]
    before = reuse.decode.disagg_stats()
    transferred = 0
    for turn in range(3):
        with_reuse = reuse.run(histories, PARAMS)
        without = plain.run(histories, PARAMS)
        expected = ref.generate(histories, PARAMS)
        for prompt, a, b, e in zip(histories, with_reuse, without, expected):
            for got in (a, b):
                assert got.prefill.error is None and got.decode.error is None, (got.prefill.error, got.decode.error)
                assert got.decode.token_ids == e.token_ids, f"turn {turn}: tokens differ from one cache-off engine"
                assert got.decode.logprobs == e.logprobs, f"turn {turn}: logprobs differ"
                assert got.decode.cached_tokens == got.prefill.cached_tokens <= len(prompt) - 1
            d = a.decode_prefix_tokens
            assert d % PAGE == 0 and a.transferred_tokens == len(prompt) - d
            if turn:
                assert d >= len(prompt) - 40 - PAGE - PARAMS.max_new_tokens, "decode reuses the whole history"
            assert b.decode_prefix_tokens == 0 and b.transferred_tokens == len(prompt), "no reuse: all of it"
            transferred += a.transferred_tokens
        extend(histories, [t.decode.token_ids for t in with_reuse], rng)
    after = reuse.decode.disagg_stats()
    assert after.received_tokens - before.received_tokens == transferred
    row_bytes = scheduler_of(reuse.decode).runner.pool.bytes_per_token  # in the dtype decode runs here
    assert after.received_bytes - before.received_bytes == transferred * row_bytes
    assert_no_leaks(reuse.prefill, reuse.decode, plain.decode)


def demote_all_but(engine: Engine, keep: list[int]) -> None:
    """On decode's scheduler thread: let every backup land, then push every cached page out of the
    device except `keep`'s (the pushed pages stay in host memory)."""
    cache = scheduler_of(engine).cache

    def run() -> None:
        for op in cache.lower.host.backups.running():
            op.done.wait()
        cache.check()
        kept = cache.tree.match_prefix(keep)  # splits where `keep` ends, and makes it the most recent
        cache.tree.evict(cache.tree.evictable_pages - len(kept.device_pages))
        assert cache.tree.match_prefix(keep).device_pages == kept.device_pages

    engine.call_in_loop(run)


def test_figure5_decode_restores_b_and_prefill_sends_only_c(engines):
    reuse, ref = engines["reuse"], engines["ref"]
    rng = random.Random(5)
    a = [rng.randrange(32, 127) for _ in range(4 * PAGE)]
    b = [rng.randrange(32, 127) for _ in range(4 * PAGE)]
    c = [rng.randrange(32, 127) for _ in range(3 * PAGE + 5)]
    (first,) = reuse.run([a + b + [33]], PARAMS)  # decode caches A + B
    assert first.decode.error is None
    demote_all_but(reuse.decode, a)  # A on decode's device, B in its host memory, C nowhere
    loads_before = reuse.decode.cache_stats().host.load_pages
    (turn,) = reuse.run([a + b + c], PARAMS)
    assert turn.decode.disagg.decode_prefix_by_tier == {"device": len(a), "host": len(b), "storage": 0}
    assert turn.transferred_tokens == len(c), "only C crosses from prefill"
    assert reuse.decode.cache_stats().host.load_pages - loads_before == len(b) // PAGE, "B was restored"
    assert turn.decode.token_ids == ref.generate([a + b + c], PARAMS)[0].token_ids
    assert_no_leaks(reuse.prefill, reuse.decode)


@pytest.mark.slow
def test_restores_of_different_requests_are_in_flight_at_once():
    port = free_ports(1)
    pre = prefill_engine(port)
    # Every host copy on decode completes up to 800 ms late, so restores are slow enough to watch.
    dec = decode_engine(reuse=True, debug=DebugConfig(debug_transfer_delay_ms=800))
    try:
        pair = PDPair(pre, dec, port)
        rng = random.Random(7)
        prompts = [[rng.randrange(32, 127) for _ in range(6 * PAGE)] for _ in range(2)]
        for turn in pair.run(prompts, PARAMS):
            assert turn.decode.error is None
        demote_all_but(dec, [])
        handles = [pair.submit(p + [40, 41], PARAMS) for p in prompts]
        scheduler = scheduler_of(dec)
        most = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(hd.req.output_ids for _, hd in handles):
            restoring = dec.call_in_loop(
                lambda: sum(
                    1 for inc in scheduler.role.transferring
                    if scheduler.cache.restore_status(inc.req.kv).state is RestoreState.RUNNING
                )
            )
            most = max(most, restoring)  # type: ignore[arg-type]
            time.sleep(0.01)
        results = [(hp.result(), hd.result()) for hp, hd in handles]
        assert most == 2, "both requests were restoring at the same time, neither waited for the other"
        for (p, d), prompt in zip(results, prompts):
            assert d.error is None and d.disagg.decode_prefix_by_tier["host"] == len(prompt)
        assert_no_leaks(pre, dec)
    finally:
        pre.shutdown()
        dec.shutdown()


@pytest.mark.slow
def test_a_cancelled_half_fails_the_other_cleanly_and_locks_balance(engines):
    reuse, ref = engines["reuse"], engines["ref"]
    rng = random.Random(9)
    prompt = [rng.randrange(32, 127) for _ in range(300)]
    long = SamplingParams(max_new_tokens=400, ignore_eos=True)
    for attempt in range(3):
        # Prefill's half goes away first (its client left while it waited for decode): decode is told.
        boot = reuse.bootstrap()
        reuse.prefill.submit(prompt, long, bootstrap=boot).cancel()
        failed = reuse.decode.submit(prompt, long, bootstrap=boot).result()
        assert failed.finish_reason == "error" and "cancelled on prefill" in (failed.error or ""), failed
        # Decode's half goes away before its KV arrives: prefill is told, and never computes it.
        boot = reuse.bootstrap()
        hd = reuse.decode.submit(prompt, long, bootstrap=boot)
        hd.cancel()
        assert hd.result().finish_reason == "abort"
        time.sleep(0.3)  # the abort reaches prefill before its half of the request does
        refused = reuse.prefill.submit(prompt, long, bootstrap=boot).result()
        assert refused.finish_reason == "error" and "decode aborted" in (refused.error or ""), refused
        # Decode's half goes away mid-generation, after prefill has sent everything.
        hp, hd = reuse.submit(prompt, long)
        while not hd.req.output_ids:
            time.sleep(0.005)
        hd.cancel()
        assert hd.result().finish_reason == "abort" and hp.result().finish_reason == "length"
        for engine in (reuse.prefill, reuse.decode):
            deadline = time.monotonic() + 10
            while engine.num_running + engine.num_waiting and time.monotonic() < deadline:
                time.sleep(0.01)
            # A write-through backup locks its node until its copy lands (each call runs a step, which
            # takes the landed copies in): on a loaded machine that can be after the requests ended.
            while (locked := engine.call_in_loop(lambda e=engine: scheduler_of(e).cache.tree.locked_nodes())) and (
                time.monotonic() < deadline
            ):
                time.sleep(0.01)
            assert locked == [], f"attempt {attempt}: locks left on {engine.config.disagg.disaggregation_mode}"
        (turn,) = reuse.run([prompt], PARAMS)  # and the next request succeeds
        assert turn.decode.token_ids == ref.generate([prompt], PARAMS)[0].token_ids
    assert_no_leaks(reuse.prefill, reuse.decode)


@pytest.mark.slow
def test_many_chunks_stage_at_most_two_and_answer_as_cache_off(engines):
    pd, ref = engines["streaming"], engines["ref"]
    rng = random.Random(11)
    for tokens in (300, 1200):  # 19 and 75 one-page chunks
        prompt = [rng.randrange(32, 127) for _ in range(tokens)]
        before = pd.prefill.disagg_stats()
        (turn,) = pd.run([prompt], PARAMS)
        assert turn.decode.error is None, turn.decode.error
        assert turn.decode.token_ids == ref.generate([prompt], PARAMS)[0].token_ids
        stats = pd.prefill.disagg_stats()
        sent = stats.sent_bytes - before.sent_bytes
        assert sent % tokens == 0 and stats.sent_tokens - before.sent_tokens == tokens, "the whole prompt crossed"
        chunk = PAGE * sent // tokens  # one page of every layer's rows
        assert 0 < stats.peak_staged_bytes <= 2 * chunk, f"{stats.peak_staged_bytes} bytes staged at once"
    assert_no_leaks(pd.prefill, pd.decode)


def test_a_decode_gone_mid_transfer_frees_the_pages_prefill_kept_for_it(engines):
    pd, ref = engines["streaming"], engines["ref"]
    rng = random.Random(13)
    prompt = [rng.randrange(32, 127) for _ in range(1200)]

    def locked() -> object:
        return pd.prefill.call_in_loop(lambda: scheduler_of(pd.prefill).cache.tree.locked_nodes())

    before = pd.prefill.disagg_stats()
    hp, hd = pd.submit(prompt, PARAMS)
    assert hp.result().finish_reason == "length", "prefill's half is final before its KV has crossed"
    deadline = time.monotonic() + 20
    while pd.prefill.disagg_stats().sent_bytes == before.sent_bytes:
        assert time.monotonic() < deadline, "no KV was ever sent"
        time.sleep(0.01)
    assert locked(), "the finished request's prefix stays locked while the transfer reads it"
    assert not pd.prefill.flush_cache(), "and a flush is refused meanwhile"
    hd.cancel()  # decode's client left: decode aborts, and tells prefill mid-transfer
    assert hd.result().finish_reason == "abort"
    assert_no_leaks(pd.prefill, pd.decode)
    assert locked() == []
    sent = pd.prefill.disagg_stats().sent_bytes - before.sent_bytes
    whole = len(prompt) * scheduler_of(pd.prefill).runner.pool.bytes_per_token
    assert sent < whole, "the transfer stopped in the middle, not at its end"
    (turn,) = pd.run([prompt[:400]], PARAMS)  # and the next request is served
    assert turn.decode.token_ids == ref.generate([prompt[:400]], PARAMS)[0].token_ids


@pytest.mark.slow
def test_a_prefill_that_computes_longer_than_the_transfer_timeout_still_lands(engines):
    """Decode's wait for KV counts from prefill's last word (WORKING, sent while the request is queued or
    computing), not from the request's start: a cold prompt whose prefill takes several timeouts lands."""
    timeout_s, step_delay_ms = 1.0, 250
    port = free_ports(1)
    slow = Engine(
        EngineConfig(
            model="tiny",
            chunked_prefill_size=32,  # 10 chunks of a slowed step: at least 2.5 timeouts
            debug=DebugConfig(debug_step_delay_ms=step_delay_ms),
            disagg=DisaggConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=port),
        )
    )
    waiting = Engine(
        EngineConfig(
            model="tiny",
            disagg=DisaggConfig(disaggregation_mode="decode", disaggregation_transfer_timeout=timeout_s),
        )
    )
    try:
        prompt = random.Random(5).choices(range(32, 127), k=320)
        started = time.monotonic()
        (turn,) = PDPair(slow, waiting, port).run([prompt], PARAMS)
        took = time.monotonic() - started
        assert turn.decode.error is None, turn.decode.error
        assert took > 2 * timeout_s, f"the prefill took {took:.1f} s: not longer than the timeout, proves nothing"
        assert turn.decode.token_ids == engines["ref"].generate([prompt], PARAMS)[0].token_ids
        assert turn.transferred_tokens == len(prompt)
    finally:
        slow.shutdown()
        waiting.shutdown()


def test_a_transfer_that_cannot_read_its_rows_fails_its_request_at_once(engines, monkeypatch):
    """A fault reading a chunk out of prefill's pages (here injected into `PoolRows.read`) ends that
    transfer and tells decode why, instead of leaving decode to wait out its transfer timeout; nothing
    leaks, and the next request is served."""
    pd, ref = engines["reuse"], engines["ref"]
    prompt = random.Random(17).choices(range(32, 127), k=100)

    def fail(self, start: int, end: int, layers=None):
        raise RuntimeError("injected read fault")

    monkeypatch.setattr(PoolRows, "read", fail)
    (turn,) = pd.run([prompt], PARAMS)
    assert turn.decode.error is not None and "prefill failed to read rows [0, 100)" in turn.decode.error
    assert "injected read fault" in turn.decode.error
    monkeypatch.undo()
    assert_no_leaks(pd.prefill, pd.decode)
    (turn,) = pd.run([prompt], PARAMS)
    assert turn.decode.error is None, turn.decode.error
    assert turn.decode.token_ids == ref.generate([prompt], PARAMS)[0].token_ids
