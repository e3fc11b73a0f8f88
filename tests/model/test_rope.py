"""RoPE scaling (hicache/model/rope.py) on checkpoints made here, from a Hugging Face config.json and from GGUF
metadata: the decoder's rotary embedding matches an independent float64 computation from the published
formulas (llama3, linear, yarn with its attention factor); a scaled checkpoint generates, with the cache
as without; a position's cos/sin do not depend on what else the step holds, up to 1,048,576 positions."""

from __future__ import annotations

import math
import pathlib

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache import Engine, SamplingParams
from hicache.errors import UserError
from hicache.model.build import build_decoder
from hicache.model.config import LoadedModel
from hicache.model.families.tiny import TINY_CONFIG
from hicache.model.loading.gguf_loader import load_gguf
from hicache.model.loading.hf_loader import load_hf_dir
from hicache.model.rope import RopeScaling, RotaryEmbedding, inverse_frequencies
from hicache.parallel.parallel import ParallelContext
from tests.model.test_gguf_loader import write_tiny_gguf
from tests.model.test_hf_loader import write_hf_dir

POSITIONS = [0, 1, 5, 31, 100, 1000, 4097, 7000]


def reference_frequencies(kind: str, dim: int, theta: float, **p: float) -> tuple[list[float], float]:
    """(inverse frequencies, attention factor) in float64, from the formulas as published: Meta's Llama 3.1
    `apply_scaling`, kaiokendev's linear interpolation, and YaRN (Peng et al. 2023, section 3)."""
    plain = [theta ** (-2 * i / dim) for i in range(dim // 2)]
    if kind == "linear":
        return [f / p["factor"] for f in plain], 1.0
    if kind == "llama3":
        out = []
        for f in plain:
            wavelen = 2 * math.pi / f
            if wavelen < p["original"] / p["high"]:
                out.append(f)
            elif wavelen > p["original"] / p["low"]:
                out.append(f / p["factor"])
            else:
                smooth = (p["original"] / wavelen - p["low"]) / (p["high"] - p["low"])
                out.append((1 - smooth) * f / p["factor"] + smooth * f)
        return out, 1.0
    assert kind == "yarn"

    def dimension(rotations: float) -> float:  # pair i turns original * theta^(-2i/dim) / 2pi times
        return dim * math.log(p["original"] / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low = max(math.floor(dimension(p.get("beta_fast", 32))), 0)
    high = min(math.ceil(dimension(p.get("beta_slow", 1))), dim - 1)
    interpolated = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
    out = [f / p["factor"] * w + f * (1 - w) for f, w in zip(plain, interpolated)]
    return out, p.get("attention", 0.1 * math.log(p["factor"]) + 1)


def check_rotary(loaded: LoadedModel, kind: str, **p: float) -> None:
    cfg = loaded.config
    rope = build_decoder(loaded, ParallelContext(), torch.float32, torch.device("cpu"), invariant=False).rope
    inv_freq, scale = reference_frequencies(kind, cfg.head_dim, cfg.rope_theta, **p)
    assert rope.inv_freq.double().numpy() == pytest.approx(inv_freq, rel=1e-6)
    assert rope.scale == pytest.approx(scale, rel=1e-12)
    angles = np.outer(POSITIONS, inv_freq)
    angles = np.concatenate([angles, angles], axis=1)
    cos, sin = rope.cos_sin(torch.tensor(POSITIONS))
    # float32 angles: a position p's angle is off by up to a few ulps of p x frequency (<= p)
    atol = 1e-6 + 4e-7 * np.array(POSITIONS)[:, None]
    assert np.all(np.abs(cos.double().numpy() - scale * np.cos(angles)) <= atol)
    assert np.all(np.abs(sin.double().numpy() - scale * np.sin(angles)) <= atol)
    # and the rotation applied to a head: x rotated pairwise (i, i + dim/2) by each pair's angle
    x = torch.randn(len(POSITIONS), 2, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    half = cfg.head_dim // 2
    a, b = x[..., :half].double().numpy(), x[..., half:].double().numpy()
    c, s = scale * np.cos(angles[:, None, :half]), scale * np.sin(angles[:, None, :half])
    expected = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    rotated = rope(x, torch.tensor(POSITIONS)).double().numpy()
    assert np.all(np.abs(rotated - expected) <= 8 * atol[:, :, None])


# llama3 over HEAD_DIM 8 at theta 500,000: wavelengths 6.3, 167, 4,443 and 118,000 positions, so with an
# original context of 8,192 one pair is kept, one blended and two stretched.
LLAMA3_HF = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}  # fmt: skip


@pytest.mark.parametrize(
    "scaling,config,kind,params,context",
    [
        (LLAMA3_HF, {"max_position_embeddings": 65536}, "llama3",
         dict(factor=8.0, low=1.0, high=4.0, original=8192), 65536),
        ({"type": "linear", "factor": 4.0}, {}, "linear", dict(factor=4.0), 512),
        # yarn at theta 10,000 over an original 2,048: the ramp runs over pairs 1..3
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
         {"rope_theta": 10000.0, "max_position_embeddings": 2048}, "yarn", dict(factor=4.0, original=2048), 8192),
        ({"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.25},
         {"rope_theta": 10000.0, "max_position_embeddings": 1024}, "yarn",
         dict(factor=8.0, original=1024, beta_fast=16, beta_slow=2, attention=1.25), 8192),
    ],
)  # fmt: skip
def test_hf_rope_scaling(tmp_path: pathlib.Path, scaling: dict, config: dict, kind: str, params: dict,
                         context: int) -> None:  # fmt: skip
    write_hf_dir(tmp_path / "m", rope_scaling=scaling, **config)
    loaded = load_hf_dir(tmp_path / "m", "m")
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling.rope_type == kind
    assert loaded.config.max_position == context
    check_rotary(loaded, kind, **params)


def test_transformers5_rope_parameters_carry_the_scaling(tmp_path: pathlib.Path) -> None:
    write_hf_dir(tmp_path / "m", rope_theta=None, rope_parameters={**LLAMA3_HF, "rope_theta": 500000.0},
                 max_position_embeddings=65536)  # fmt: skip
    check_rotary(load_hf_dir(tmp_path / "m", "m"), "llama3", factor=8.0, low=1.0, high=4.0, original=8192)


def llama_cpp_rope_freqs(dim: int, theta: float, factor: float, low: float, high: float, original: int) -> list[float]:
    """llama.cpp's converter's `rope_freqs.weight` for a llama3 checkpoint: each frequency's divisor."""
    out = []
    for i in range(dim // 2):
        wavelen = 2 * math.pi * theta ** (2 * i / dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


# The GGUF helper's theta is 5,000: over head_dim 8 the wavelengths are 6.3, 53, 444 and 3,735 positions.
GGUF_LLAMA3 = dict(factor=8.0, low=1.0, high=4.0, original=1024)


def _llama3_freqs(writer: gguf.GGUFWriter) -> None:
    freqs = llama_cpp_rope_freqs(8, 5000.0, **GGUF_LLAMA3)
    writer.add_tensor("rope_freqs.weight", np.array(freqs, dtype=np.float32))


def _yarn(writer: gguf.GGUFWriter) -> None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(256)


def _yarn_attn_factor(writer: gguf.GGUFWriter) -> None:
    _yarn(writer)
    writer.add_rope_scaling_attn_factors(0.5)


def _linear(writer: gguf.GGUFWriter) -> None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)


@pytest.mark.parametrize(
    "extra,kind,params,context",
    [
        (_llama3_freqs, "llama3", GGUF_LLAMA3, 64),
        (_yarn, "yarn", dict(factor=4.0, original=256), 1024),
        # llama.cpp multiplies yarn's own attention factor by the file's
        (_yarn_attn_factor, "yarn", dict(factor=4.0, original=256, attention=0.5 * (0.1 * math.log(4.0) + 1)), 1024),
        (_linear, "linear", dict(factor=2.0), 128),
    ],
)
def test_gguf_rope_scaling(tmp_path: pathlib.Path, extra, kind: str, params: dict, context: int) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", head_dim=8, extra=extra)
    loaded = load_gguf(tmp_path / "m.gguf", "m")
    assert "rope_freqs.weight" not in loaded.weights and loaded.config.max_position == context
    check_rotary(loaded, kind, **params)


def test_gguf_unknown_rope_scaling_is_refused(tmp_path: pathlib.Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE))
    with pytest.raises(UserError, match="rope scaling 'longrope' is not supported"):
        load_gguf(tmp_path / "m.gguf", "m")


def test_a_llama3_scaled_checkpoint_generates_with_the_cache_as_without(tmp_path: pathlib.Path) -> None:
    """Past the original context of 32, so the stretched frequencies are used; the second prompt extends
    the first, so its prefix comes from the cache."""
    scaling = {**LLAMA3_HF, "original_max_position_embeddings": 32}
    write_hf_dir(tmp_path / "m", rope_scaling=scaling, max_position_embeddings=256)
    prompts = ["the quick brown fox jumps over the lazy dog " * n for n in (10, 12)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outputs = []
    for cache_off in (True, False):
        with Engine(model=str(tmp_path / "m"), max_total_tokens=1024, disable_radix_cache=cache_off) as engine:
            results = [engine.generate([p], params)[0] for p in prompts]
            outputs.append([r.token_ids for r in results])
            if not cache_off:
                assert results[1].cached_tokens >= 64
    assert outputs[0] == outputs[1] and all(len(ids) == 8 for ids in outputs[0])


def test_cos_sin_of_a_position_do_not_depend_on_the_step_up_to_1m_positions() -> None:
    """Rows alone, together, and at one thread or two, bit for bit; the angle is the float32 product of
    position and frequency, as transformers computes it; nothing is kept that grows with the context."""
    rope = RotaryEmbedding(TINY_CONFIG.head_dim, TINY_CONFIG.rope_theta, None, torch.device("cpu"))
    positions = torch.tensor([0, 4095, 4096, 65537, (1 << 20) - 17, (1 << 20) - 1], dtype=torch.int64)
    together = rope.cos_sin(positions)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for i, p in enumerate(positions):
                alone = rope.cos_sin(p.view(1))
                assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i])
    finally:
        torch.set_num_threads(threads)
    angles = (positions.float().unsqueeze(1) * rope.inv_freq).double()
    assert torch.allclose(together[0][:, : TINY_CONFIG.head_dim // 2].double(), angles.cos(), atol=1e-6, rtol=0)
    assert [t.numel() for t in vars(rope).values() if isinstance(t, torch.Tensor)] == [TINY_CONFIG.head_dim // 2]


@given(
    theta=st.floats(100.0, 1e7),
    half=st.integers(1, 64),
    factor=st.floats(1.0, 64.0),
    low=st.floats(0.5, 4.0),
    gap=st.floats(0.5, 16.0),
    original=st.integers(16, 1 << 17),
)
def test_llama3_frequencies_stay_between_plain_and_stretched_and_keep_their_order(
    theta: float, half: int, factor: float, low: float, gap: float, original: int
) -> None:
    scaling = RopeScaling("llama3", factor=factor, low_freq_factor=low, high_freq_factor=low + gap,
                          original_max_position=original)  # fmt: skip
    plain = inverse_frequencies(2 * half, theta, None).double()
    scaled = inverse_frequencies(2 * half, theta, scaling).double()
    slack = 1e-6
    assert torch.all(scaled <= plain * (1 + slack)) and torch.all(scaled >= plain / factor * (1 - slack))
    assert torch.all(scaled[1:] <= scaled[:-1] * (1 + slack))  # lower frequencies stay lower
    wavelen = 2 * math.pi / plain
    short, long = wavelen < original / (low + gap), wavelen > original / low
    assert torch.allclose(scaled[short], plain[short], rtol=slack, atol=0)  # high frequencies untouched
    assert torch.allclose(scaled[long], plain[long] / factor, rtol=slack, atol=0)


def test_rotation_keeps_cos_sin_only_for_equal_positions() -> None:
    """A forward pass's layers rotate by the same positions, so RoPE keeps their cos/sin: the kept ones
    must serve equal positions only, whether the positions are new tensors, the same tensor changed in
    place, or inference tensors (which have no version counter: a CP rank's step makes them)."""
    rope = RotaryEmbedding(8, 10_000.0, None, torch.device("cpu"))
    x = torch.randn(3, 2, 8)

    def fresh(positions: torch.Tensor) -> torch.Tensor:
        cos, sin = (t.unsqueeze(1) for t in rope.cos_sin(positions))
        return x * cos + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin

    positions = torch.tensor([0, 7, 300])
    assert torch.equal(rope(x, positions), fresh(positions))
    positions[1] = 8  # the same tensor, changed in place
    assert torch.equal(rope(x, positions), fresh(positions))
    with torch.inference_mode():
        made_inside = torch.tensor([2, 3, 4])[torch.tensor([0, 1, 2])]
        assert torch.equal(rope(x, made_inside), fresh(made_inside))
        assert torch.equal(rope(x, made_inside + 1), fresh(made_inside + 1))
