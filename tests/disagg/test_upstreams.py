"""The router's view of its servers (hicache/router/upstreams.py): a pair that may not exchange KV is
refused at start-up with one line naming it, and under the first-message policy a request's pair
follows its prefix (hicache/router/policies.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from hicache.errors import UserError
from hicache.router.policies import FirstMessage, affinity_key
from hicache.router.upstreams import Fleet, Upstream, check_pairs
from tests.disagg.test_handshake import BASE


def upstream(url: str, role: str, **handshake: object) -> Upstream:
    return Upstream(url, role, "tiny", dataclasses.replace(BASE, **handshake), "127.0.0.1", 9000)


def test_a_pair_that_may_not_exchange_kv_is_refused_by_name():
    half = (("k", (1, 32)), ("v", (1, 32)))
    prefills = [upstream("http://p1", "prefill"), upstream("http://p2", "prefill", tp_size=2, kv_layout=half),
                upstream("http://p3", "prefill", pp_size=2, layers=(0, 2))]  # fmt: skip
    decodes = [upstream("http://d1", "decode")]
    check_pairs(prefills, decodes)  # other TP and PP sizes pair
    with pytest.raises(UserError, match=r"cannot pair prefill http://p1 with decode http://d1: page size differs"):
        check_pairs(prefills, [upstream("http://d1", "decode", page_size=32)])
    latent = (("latent", (48,)), ("rope", (16,)))
    with pytest.raises(UserError, match=r"decode http://d1 rank tp0/pp0 needs KV heads 0-0 of prefill http://p2"):
        check_pairs([upstream("http://p2", "prefill", tp_size=2, kv_layout=latent)],
                    [upstream("http://d1", "decode", kv_layout=latent)])  # fmt: skip
    mtp = {"draft": "tiny-mtp (3f0c2a9e11b7)", "draft_layers": 1, "draft_kv_layout": half}
    with pytest.raises(UserError, match=r"http://d1: speculative draft \(--speculative-draft-model\) differs: "
                                        r"prefill http://p1 tiny-mtp \(3f0c2a9e11b7\), decode http://d1 none"):
        check_pairs([upstream("http://p1", "prefill", **mtp)], decodes)  # fmt: skip
    renamed = dataclasses.replace(decodes[0], served_model_name="other")
    with pytest.raises(UserError, match="served model name differs"):
        check_pairs(prefills[:1], [renamed])


def test_a_requests_pair_follows_its_first_message_or_prompt_head():
    fleet = Fleet(
        [upstream(f"http://p{i}", "prefill") for i in range(2)], [upstream(f"http://d{i}", "decode") for i in range(3)]
    )
    policy = FirstMessage()

    def pick(body: dict) -> tuple[Upstream, ...]:
        return tuple(asyncio.run(policy.choose(body, fleet.groups, {})).servers)

    system = {"role": "system", "content": "shared"}
    turn1 = {"messages": [system, {"role": "user", "content": "a"}]}
    turn2 = {"messages": [system, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert pick(turn1) == pick(turn2), "a conversation keeps its pair"
    assert affinity_key({"prompt": "x" * 5000}) == affinity_key({"prompt": "x" * 6000})
    assert affinity_key({"prompt": [["a"], ["b"]]}) != b""
    picks = {pick({"prompt": f"conversation {i}"}) for i in range(60)}
    assert {p.url for p, _ in picks} == {"http://p0", "http://p1"} and len({d.url for _, d in picks}) == 3
    with pytest.raises(UserError):
        Fleet([], fleet.decodes)
    with pytest.raises(UserError, match="either plain servers"):
        Fleet(fleet.prefills, fleet.decodes, [upstream("http://s0", "null")])
