"""What a prefill-decode pair must share (hicache/disagg/handshake.py), and what prefill refuses in
decode's metadata (hicache/disagg/prefill_role.py): every mismatch is named, never served."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hicache.disagg.handshake import Handshake
from hicache.disagg.prefill_role import metadata_problem
from hicache.disagg.transfer import DecodeMetadata
from hicache.disagg.wire import WireError, decode, encode, metadata_header, parse_metadata, prompt_digest, word_every
from hicache.scheduler.request import Request, SamplingParams

BASE = Handshake(
    model="m" * 64,
    dtype="bfloat16",
    page_size=16,
    tp_size=1,
    tp_rank=0,
    pp_size=1,
    pp_rank=0,
    layers=(0, 4),
    num_layers=4,
    num_kv_heads=2,
    latent=False,
    kv_layout=(("k", (2, 32)), ("v", (2, 32))),
    verified=True,
    mechanisms=(("attention", "keys padded to 512"), ("linear q_proj", "onednn, granule 1")),
)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model": "x" * 64}, "model"),
        ({"dtype": "float32"}, "KV dtype"),
        ({"page_size": 32}, "page size"),
        ({"num_layers": 6}, "number of layers"),
        ({"num_kv_heads": 4}, "number of KV heads"),
        ({"latent": True}, "KV replication"),
        ({"mechanisms": (("attention", "other"),)}, "kernel mechanism 'attention'"),
        ({"verified": False}, "self-check did not pass on decode"),
    ],
)
def test_every_difference_is_named(change, named):
    other = dataclasses.replace(BASE, **change)
    problem = BASE.mismatch(other)
    assert problem is not None and named in problem
    assert BASE.mismatch(BASE) is None


def test_a_kernel_only_one_side_runs_and_the_topology_are_not_compared():
    # Prefill's first stage of two runs no LM head; decode at TP2 holds half the KV heads.
    first_stage = dataclasses.replace(BASE, pp_size=2, layers=(0, 2), mechanisms=BASE.mechanisms[:1])
    tp2 = dataclasses.replace(BASE, tp_size=2, kv_layout=(("k", (1, 32)), ("v", (1, 32))))
    assert first_stage.mismatch(tp2) is None


def test_handshakes_survive_the_wire():
    assert Handshake.from_json(json.loads(json.dumps(BASE.to_json()))) == BASE
    with pytest.raises(ValueError, match="malformed"):
        Handshake.from_json({"model": "m"})


def test_metadata_survives_the_wire_and_bad_messages_are_refused():
    meta = DecodeMetadata(7, 32, 40, prompt_digest(range(40)), BASE)
    kind, header, payload = decode(encode(b"meta", metadata_header(meta, 15.0)))
    assert kind == b"meta" and payload == [] and parse_metadata(header) == meta
    assert word_every(header) == 15.0
    for bad in ({}, {"word_every_s": 0}, {"word_every_s": "soon"}):
        with pytest.raises(WireError, match="word_every_s|bad metadata"):
            word_every(bad)
    for frames in ([b"meta"], [b"nope", b"{}"], [b"meta", b"not json"], [b"meta", b'{"no": "room"}']):
        with pytest.raises(WireError):
            decode(frames)


@pytest.mark.parametrize(
    ("d", "length", "other_prompt", "handshake", "named"),
    [
        (32, 40, False, BASE, None),
        (0, 40, False, BASE, None),
        (32, 32, False, BASE, None),  # a whole prompt decode already holds: only the first token is sent
        (24, 40, False, BASE, "invalid decode_prefix_len 24"),  # not page-aligned
        (48, 40, False, BASE, "invalid decode_prefix_len 48"),  # beyond the prompt
        (-16, 40, False, BASE, "invalid decode_prefix_len -16"),
        (16, 40, True, BASE, "another prompt"),
        (16, 40, False, dataclasses.replace(BASE, dtype="float32"), "handshake refused: KV dtype differs"),
    ],
)
def test_prefill_validates_decode_prefix_len(d, length, other_prompt, handshake, named):
    req = Request(list(range(length)), SamplingParams(), 1)
    decodes = list(range(1, length + 1)) if other_prompt else req.prompt_ids
    meta = DecodeMetadata(1, d, length, prompt_digest(decodes), handshake)
    problem = metadata_problem(meta, req, BASE)
    assert (problem is None) if named is None else (named in (problem or ""))


def test_prompt_digest_is_pinned():
    # Values of the per-token encoding the digest had first: prefill and decode of different versions
    # must still agree on a prompt.
    tokens = [(i * 2654435761) % 2**32 for i in range(64)]
    assert prompt_digest(tokens) == "b2c7f273d99052b2d7da6144145296af"
    assert prompt_digest([]) == "cae66941d9efbd404e4d88758ea67670"
    assert prompt_digest(range(40)) == "2a8c97b25630d526f923a10555c69ff4"
    with pytest.raises((OverflowError, ValueError)):
        prompt_digest([2**32])


MTP = dataclasses.replace(BASE, draft="tiny-mtp (3f0c2a9e11b7)", draft_layers=1,
                          draft_kv_layout=(("k", (2, 32)), ("v", (2, 32)), ("hidden", (64,))))  # fmt: skip


@pytest.mark.parametrize(
    ("prefill", "decode", "named"),
    [
        (MTP, BASE, "speculative draft (--speculative-draft-model) differs: prefill tiny-mtp (3f0c2a9e11b7), "
                    "decode none"),
        (MTP, dataclasses.replace(MTP, draft="tiny-draft-packed (9d1e00aa4c2b)"),
         "differs: prefill tiny-mtp (3f0c2a9e11b7), decode tiny-draft-packed (9d1e00aa4c2b)"),
        (MTP, dataclasses.replace(MTP, draft_layers=0, draft_kv_layout=()), "draft layers a transfer moves"),
        (MTP, dataclasses.replace(MTP, tp_size=2, kv_layout=(("k", (1, 32)), ("v", (1, 32)))),
         "speculative decoding between two TP sizes is not supported yet (prefill TP1, decode TP2)"),
    ],
)  # fmt: skip
def test_a_pair_whose_drafts_differ_is_refused_naming_both(prefill, decode, named):
    req = Request(list(range(40)), SamplingParams(), 1)
    meta = DecodeMetadata(1, 16, 40, prompt_digest(req.prompt_ids), decode)
    assert named in (metadata_problem(meta, req, prefill) or "")
    assert metadata_problem(DecodeMetadata(1, 16, 40, prompt_digest(req.prompt_ids), prefill), req, prefill) is None


def test_a_draft_survives_the_wire_and_its_rows_count_in_a_tokens_bytes():
    assert Handshake.from_json(json.loads(json.dumps(MTP.to_json()))) == MTP
    assert MTP.row_bytes == BASE.row_bytes + (128 + 64) * 2  # bfloat16: the head's K, V and hidden state
