"""A request's handle, streamed (a wake-up a token) or not (`stream=False`, what `generate` uses: one
wake-up at the end), hands its reader the same events in the same order."""

from hicache import Engine, SamplingParams


def test_a_held_request_yields_the_streamed_events_in_order():
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        streamed = list(engine.submit([5, 6, 7, 8], params))
        held_handle = engine.submit([5, 6, 7, 8], params, stream=False)
        held = list(held_handle)
        again = engine.submit([5, 6, 7, 8], params, stream=False).result()
    assert len(held) == len(streamed) > 2
    assert [e.new_token_ids for e in held] == [e.new_token_ids for e in streamed]
    assert [e.finish_reason for e in held] == [e.finish_reason for e in streamed]
    assert again.token_ids == [t for e in streamed for t in e.new_token_ids]
