"""Rotary position embedding (docs/DESIGN.md, "model family"): the inverse frequencies of plain RoPE and of its
scaled variants, `linear`, `llama3` and `yarn` (with yarn's attention factor on cos/sin), and a GGUF's
per-frequency divisors (`rope_freqs.weight`, llama.cpp's form of llama3). The frequencies are computed as
Hugging Face transformers' `_compute_*_parameters` compute them: in float32, in the same order of operations,
so a checkpoint rotates here as it does there.

cos/sin are computed from each step's positions, not read from a table: a table up to a 1,048,576-token
context would hold 2 x positions x dim/2 values (128 MB for tiny's 32-wide heads in float32) whatever the
conversation's length, while a step's rows cost only its own tokens. A position's values do not depend on
what else the step holds: torch's cos/sin are elementwise and give one value per input whatever the
tensor's size or thread split (tests/model/test_rope.py checks it bitwise; the start-up self-check compares
rows computed in prefill and decode shapes), and they are the values the up-front table held before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hicache.errors import UserError
from hicache.model.kernels import ops

SCALED_TYPES = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling, in Hugging Face's `rope_scaling` terms. `rope_type` is one of
    SCALED_TYPES, or "default" for a GGUF whose only scaling is `freq_factors`, which divide the type's
    inverse frequencies (llama.cpp's `rope_freqs.weight`)."""

    rope_type: str
    factor: float = 1.0
    original_max_position: int = 0  # llama3, yarn: the context the model was pretrained at
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # the cos/sin multiplier; None: yarn's from factor and mscale, else 1
    mscale: float = 0.0  # yarn (DeepSeek's): attention_factor = mscale(factor, mscale) / mscale(factor, all_dim)
    mscale_all_dim: float = 0.0
    truncate: bool = True  # yarn: the correction range rounded outwards to whole dimensions
    freq_factors: tuple[float, ...] = ()


def from_hf(params: dict[str, Any], max_position: int, where: str) -> RopeScaling | None:
    """The scaling a Hugging Face `rope_scaling` (or transformers 5 `rope_parameters`) dict describes;
    `max_position` is the config's max_position_embeddings, yarn's defaults derive from it as
    transformers 5 derives them."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind not in SCALED_TYPES:
        raise UserError(f"{where}: rope scaling {kind!r} is not supported (only {', '.join(SCALED_TYPES)})")

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise UserError(f"{where}: rope scaling {kind!r} lacks {key}")
        return params[key]

    try:
        if kind == "linear":
            return RopeScaling(kind, factor=float(need("factor")))
        if kind == "llama3":
            return RopeScaling(kind, factor=float(need("factor")), low_freq_factor=float(need("low_freq_factor")),
                               high_freq_factor=float(need("high_freq_factor")),
                               original_max_position=int(need("original_max_position_embeddings")))  # fmt: skip
        original = int(params.get("original_max_position_embeddings") or max_position)
        attention = params.get("attention_factor")
        return RopeScaling(
            kind,
            factor=float(params.get("factor") or max_position / original),
            original_max_position=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=None if attention is None else float(attention),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            truncate=bool(params.get("truncate", True)),
        )
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: rope scaling {kind!r} is invalid: {exc}") from exc


def scaled_context(max_position: int, scaling: RopeScaling | None) -> int:
    """The context a checkpoint serves: linear scaling stretches the configured one, yarn the original one,
    by `factor`; llama3 configs already state the stretched one. vLLM's reading of the same fields."""
    if scaling is None:
        return max_position
    if scaling.rope_type == "linear":
        return int(max_position * scaling.factor)
    if scaling.rope_type == "yarn":
        return max(max_position, int(scaling.original_max_position * scaling.factor))
    return max_position


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[dim // 2] float32: the angle per position of each rotated pair."""
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / powers
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn(powers, dim, theta, scaling)
    if scaling.freq_factors:
        inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Wavelengths longer than original / low_freq_factor are stretched by `factor`, shorter than
    original / high_freq_factor kept, and those between blended smoothly."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * stretched / s.factor + smooth * stretched
    between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(between, blended, stretched)


def _yarn(powers: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Dimensions that turn more than beta_fast times over the original context keep their frequency
    (extrapolation), those turning fewer than beta_slow times are divided by `factor` (interpolation),
    with a linear ramp between."""

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one dimension: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (s.factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: one the checkpoint states, else yarn's softmax temperature
    correction, else 1."""
    if scaling is not None and scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


class RotaryEmbedding:
    """Rotates heads by their positions (Hugging Face's rotate-half order), computing cos/sin per step:
    every layer of a forward pass rotates by the same positions, so the last positions' cos/sin are kept
    and reused for equal positions (a copy of them kept beside, compared by value: cos/sin depend on
    nothing else, and a positions tensor made under inference mode has no version counter to tell a
    change by), which saves a dozen small ops a layer for one comparison and changes no bit."""

    def __init__(self, dim: int, theta: float, scaling: RopeScaling | None, device: torch.device):
        self.inv_freq = inverse_frequencies(dim, theta, scaling).to(device)
        self.scale = attention_factor(scaling)
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, dim] float32 each: the angles are float32 products position x inverse frequency, as
        transformers computes them."""
        angles = positions.to(torch.float32).unsqueeze(1) * self.inv_freq
        cos, sin = angles.cos() * self.scale, angles.sin() * self.scale
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, dim] in `dtype`, kept for the next call at equal positions."""
        last = self._last
        if last is not None and last[1] == dtype and torch.equal(last[0], positions):
            return last[2], last[3]
        cos, sin = (t.to(dtype).unsqueeze(1) for t in self.cos_sin(positions))
        self._last = (positions.clone(), dtype, cos, sin)
        return cos, sin

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, dim]."""
        return ops.rotate(x, *self.tables(positions, x.dtype))
