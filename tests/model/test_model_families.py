"""Each model family against transformers' own implementation (tests/model/hf_reference.py): hicache's
log-probabilities of every position of a prompt longer than the sliding window are transformers' within
1e-3 nats, its greedy continuation is transformers' argmax at every step, and with a host tier and cache
hits the answer is the cache-off one, token for token."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.build import build_decoder, with_weight_format
from hicache.model.kernels import fused_layer, native, ops
from hicache.model.kernels.invariance import feed
from hicache.model.loading.gguf_loader import load_gguf
from hicache.model.loading.hf_loader import load_hf_dir
from hicache.parallel.parallel import ParallelContext
from tests.model.hf_reference import FAMILIES, WINDOW, reference_logprobs, save_checkpoint, save_gguf

NATS = 1e-3
INT8_NATS = 0.5  # int8 weights' error on these checkpoints: 0.03 (Qwen2) to 0.25 (Gemma 2) nats
CPU = torch.device("cpu")
PROMPT = [(7 * i + 11) % 290 + 5 for i in range(3 * WINDOW)]  # longer than the window, no special token


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> tuple[str, pathlib.Path, object]:
    root = tmp_path_factory.mktemp(request.param)
    return request.param, root, save_checkpoint(request.param, root)


def hicache_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    model = build_decoder(loaded, ParallelContext(), torch.float32, CPU)
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, 8, 16, torch.float32, CPU)
    return torch.log_softmax(feed(model, pool, torch.tensor(ids), [len(ids) - 5, len(ids)], 0).float(), dim=-1)


@pytest.mark.slow
def test_every_position_is_the_references_within_a_millinat(checkpoint):
    """Prefill in two chunks (the second a decode-sized one): every position's distribution, not only its argmax."""
    family, root, reference = checkpoint
    ours = hicache_logprobs(load_hf_dir(root, family), PROMPT)
    theirs = reference_logprobs(reference, PROMPT)
    assert (ours - theirs).abs().max().item() < NATS
    assert (theirs.max(-1).values - theirs.min(-1).values).min() > 1.0, "flat logits would prove nothing"


def test_greedy_tokens_are_the_references_argmax_and_a_host_tier_keeps_them(checkpoint, tmp_path):
    """Through the engine in float32: each generated token is transformers' argmax (within 1e-3 nats) given
    the tokens before it; a second engine with a host tier answers a repeat and an extension of the prompt
    from its cache, token for token the cache-off answer."""
    family, root, reference = checkpoint
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [PROMPT, PROMPT + [9, 8, 7, 6, 5, 4, 3, 2] * 4]
    with Engine(model=str(root), dtype="float32", disable_radix_cache=True) as engine:
        expected = [engine.generate([p], params)[0].token_ids for p in prompts]
    for prompt, out in zip(prompts, expected):
        logprobs = reference_logprobs(reference, prompt + out[:-1])[len(prompt) - 1 :]
        chosen = logprobs.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
        assert (logprobs.max(-1).values - chosen).max().item() < NATS, family
    host = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=2.0)
    with Engine(model=str(root), dtype="float32", page_size=16, hicache=host) as engine:
        first = engine.generate([prompts[0]], params)[0]
        again = [engine.generate([p], params)[0] for p in prompts]
    assert [first.token_ids, *[r.token_ids for r in again]] == [expected[0], *expected]
    # Sliding families keep a finished request's last window only, so the repeat may miss where the extension hits.
    assert sum(r.cached_tokens for r in again) >= 32, [r.cached_tokens for r in again]


def test_the_family_is_read_from_config_json(checkpoint):
    family, root, _ = checkpoint
    loaded = load_hf_dir(root, family)
    parts = loaded.config.parts
    assert parts.qkv_bias == (family == "qwen2")
    assert parts.qk_norm == (family in ("qwen3", "gemma3"))
    assert parts.sandwich_norms == family.startswith("gemma")
    assert parts.activation == ("gelu_tanh" if family.startswith("gemma") else "silu")
    assert (loaded.family == "hybrid") == family.startswith("gemma")
    assert dataclasses.asdict(parts)["local_rope_theta"] == (10000.0 if family == "gemma3" else None)


def _scaled(name: str, by: float):
    def mutate(loaded):
        return dataclasses.replace(loaded, weights={n: w * by if name in n else w for n, w in loaded.weights.items()})

    return mutate


def _without(**changes):
    def mutate(loaded):
        config = loaded.config
        if "sliding_window" in changes:
            return dataclasses.replace(loaded, config=dataclasses.replace(config, **changes))
        return dataclasses.replace(loaded, config=dataclasses.replace(config, parts=dataclasses.replace(config.parts,
                                                                                                        **changes)))  # fmt: skip

    return mutate


def _norms_without_one_plus(loaded):
    return dataclasses.replace(loaded, weights={n: w - 1.0 if n.endswith("norm.weight") else w
                                                for n, w in loaded.weights.items()})  # fmt: skip


def _gate_up_swapped(loaded):
    swapped = {"gate_proj": "up_proj", "up_proj": "gate_proj"}
    return dataclasses.replace(loaded, weights={re.sub("gate_proj|up_proj", lambda m: swapped[m.group()], n): w
                                                for n, w in loaded.weights.items()})  # fmt: skip


MUTATIONS = {
    "qwen2-bias-ignored": ("qwen2", _scaled("_proj.bias", 0.0)),
    "qwen3-qk-norm-ignored": ("qwen3", _without(qk_norm=False)),
    "phi3-gate-up-swapped": ("phi3", _gate_up_swapped),
    "gemma2-one-plus-dropped": ("gemma2", _norms_without_one_plus),
    "gemma2-softcap-off": ("gemma2", _without(final_logit_softcap=None)),
    "gemma3-window-off-by-one": ("gemma3", _without(sliding_window=WINDOW + 1)),
    "gemma3-local-rope-base-ignored": ("gemma3", _without(local_rope_theta=None)),
    "gemma3-silu-for-gelu": ("gemma3", _without(activation="silu")),
    "gemma3-embedding-unscaled": ("gemma3", _without(embedding_scale=1.0)),
    "gemma3-attention-scale-of-head-dim": ("gemma3", _without(attention_scale=None)),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_family_part_changed_fails_the_reference_check(mutation, tmp_path):
    """Each part the families add is seen by the reference check: with it changed, some position is off
    by far more than the tolerance."""
    family, mutate = MUTATIONS[mutation]
    reference = save_checkpoint(family, tmp_path)
    ours = hicache_logprobs(mutate(load_hf_dir(tmp_path, family)), PROMPT)
    assert (ours - reference_logprobs(reference, PROMPT)).abs().max().item() > 100 * NATS


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_native_head_computes_qwens_biases_and_qk_norm_bit_for_bit(family, tmp_path):
    """In int8 (the native kernels' format) a Qwen layer's head (q/k/v biases, QK-norm) is one native call:
    the bits of its Python path at any row count, in both activation dtypes."""
    assert native.library() is not None, "the native build is part of `make setup`"
    save_checkpoint(family, tmp_path, head_dim=16)  # rotary halves of 8 lanes, as the native rows take
    loaded = with_weight_format(load_hf_dir(tmp_path, family), "int8", CPU)
    for dtype in (torch.float32, torch.bfloat16):
        model = build_decoder(loaded, ParallelContext(), dtype, CPU)
        layer, eps = model.layers[-1], model.cfg.rms_norm_eps
        assert all(each.head is not None for each in model.layers)
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for rows in (1, 5, 37):
                hidden = torch.randn(rows, model.cfg.hidden_size, generator=gen).to(dtype)
                positions = torch.randint(0, 4096, (rows,), generator=gen)
                q, kv = layer.head(hidden, *model.rope.tables(positions, dtype))
                expected_q, k, v = model._qkv(layer, ops.rms_norm(hidden, layer.input_norm, eps), positions)
                assert torch.equal(q, expected_q) and torch.equal(kv, model.attention_layout.pack({"k": k, "v": v}))


@pytest.mark.slow
def test_the_fused_native_layer_stands_in_only_for_the_parts_it_computes(tmp_path, monkeypatch):
    """The native tail computes Llama's parts, not Gemma's output norms and GELU: a Gemma 2 in int8 keeps its
    Python tail and transformers' answer within int8's error; were the tail to claim Gemma's parts
    (`tail_accepts`), it would stand in and the answer be wrong."""
    assert native.library() is not None, "the native build is part of `make setup`"
    reference = save_checkpoint("gemma2", tmp_path)
    theirs = reference_logprobs(reference, PROMPT)
    loaded = with_weight_format(load_hf_dir(tmp_path, "gemma2"), "int8", CPU)
    model = build_decoder(loaded, ParallelContext(), torch.float32, CPU)
    assert all(layer.tail is None for layer in model.layers)
    assert (hicache_logprobs(loaded, PROMPT) - theirs).abs().max().item() < INT8_NATS
    monkeypatch.setattr(fused_layer, "tail_accepts", lambda parts: True)
    assert all(layer.tail is not None for layer in build_decoder(loaded, ParallelContext(), torch.float32, CPU).layers)
    assert (hicache_logprobs(loaded, PROMPT) - theirs).abs().max().item() > 4 * INT8_NATS  # 5.8 nats


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_gguf_llama_cpp_converts_it_to_is_the_reference_too(family, tmp_path):
    """llama.cpp infers some of Gemma's config: scores scaled by head_dim ** -0.5 (every size but 27B) and
    Gemma 3's every sixth layer global: so does the checkpoint here. Phi-3's fused q/k/v and gate/up are stored in Q8_0: their codes split into the decoder's
    projections, and the int8 kernels answer within int8's error."""
    overrides = {"query_pre_attn_scalar": 16} if family.startswith("gemma") else {}
    if family == "gemma3":
        overrides |= {"num_hidden_layers": 6, "layer_types": None}
    reference = save_checkpoint(family, tmp_path / "hf", **overrides)
    quantize = ("qkv_proj", "gate_up_proj") if family == "phi3" else ()
    save_gguf(family, reference, tmp_path / "m.gguf", quantize)
    loaded = load_gguf(tmp_path / "m.gguf", family)
    from_hf = load_hf_dir(tmp_path / "hf", family).config  # the same config but for the file's float32 epsilon
    assert loaded.config.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(loaded.config, rms_norm_eps=from_hf.rms_norm_eps) == from_hf
    theirs = reference_logprobs(reference, PROMPT)
    if quantize:
        assert {n.split(".")[-2] for n in loaded.quantized} == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
        loaded = with_weight_format(loaded, "int8", CPU)
    tolerance = INT8_NATS if quantize else NATS
    assert (hicache_logprobs(loaded, PROMPT) - theirs).abs().max().item() < tolerance
