"""Weights kept as integer codes: what a GGUF's quantized tensors hold, and what the packed matmuls take.

A `QuantizedWeight` [N, K] is codes with one scale (and, when asymmetric, one offset) per group of
`group` consecutive inputs of a row: value = code * scale + offset. GGUF Q4_1 blocks are exactly that
with 4-bit codes 0..15, group 32 (scale d, offset m); Q8_0 blocks are symmetric 8-bit codes, group
32. The model slices and concatenates weights for tensor parallelism and fused projections before
they become matmuls, so a quantized weight supports the same row and column selections as a tensor
(`w[a:b]`, `w[:, a:b]` on group boundaries, `w[index]`, `torch.cat`) and dequantizes on `.to`.

The two formats the CPU kernels take (hicache/model/kernels/ops.py): "int4", 4-bit codes in groups of 32
with an offset (`aten._weight_int4pack_mm_for_cpu`), and "int8", symmetric 8-bit codes with one
scale per output row (`aten._weight_int8pack_mm`). `as_format` converts: a Q4_1 tensor is already
int4; anything else is quantized again from its values (Q8_0's 32-blocks have no per-row scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

INT4_GROUP = 32
FORMATS = ("int4", "int8")
QUANTIZATIONS = ("auto", "none", *FORMATS)  # what --quantization takes (hicache/model/build.py resolves it)


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # [N, K] int8 (int4 codes are 0..15)
    scale: torch.Tensor  # [N, K // group] float32
    offset: torch.Tensor | None  # [N, K // group] float32; None: symmetric
    group: int
    bits: int
    source: str  # where the codes came from: a GGUF type ("Q4_1", "Q8_0") or "requantized"

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def format(self) -> str:
        """The kernel format these codes already are ("" when neither: they must be converted)."""
        if self.bits == 4 and self.group == INT4_GROUP and self.offset is not None:
            return "int4"
        if self.bits == 8 and self.group == self.shape[1] and self.offset is None:
            return "int8"
        return ""

    @property
    def kernel_format(self) -> str:
        """The kernel format nearest these codes: int4 for 4-bit ones (Q4_1 as it is), int8 for 8-bit
        ones (Q8_0 with a scale per row instead of per 32)."""
        return "int4" if self.bits == 4 else "int8"

    def dequantize(self) -> torch.Tensor:
        """The float32 values [N, K] (bitwise what llama.cpp's and gguf's dequantization give)."""
        n, k = self.shape
        grouped = self.codes.view(n, k // self.group, self.group).float() * self.scale[..., None]
        if self.offset is not None:
            grouped = grouped + self.offset[..., None]
        return grouped.view(n, k)

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense values, as a tensor's `to` would give them: for what stays dense (an embedding table)."""
        return self.dequantize().to(device=device, dtype=dtype)

    def __getitem__(self, index: Any) -> QuantizedWeight:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        codes, scale, offset = self.codes[rows], self.scale[rows], None if self.offset is None else self.offset[rows]
        if cols != slice(None):
            start, stop, step = cols.indices(self.shape[1])
            if step != 1 or start % self.group or (stop % self.group and stop != self.shape[1]):
                raise ValueError(f"a quantized weight's columns split only on its {self.group}-input groups")
            g = slice(start // self.group, -(-stop // self.group))
            codes, scale = codes[:, start:stop], scale[:, g]
            offset = None if offset is None else offset[:, g]
        offset = None if offset is None else offset.contiguous()
        return QuantizedWeight(codes.contiguous(), scale.contiguous(), offset, self.group, self.bits, self.source)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Only row concatenation (fused projections); anything else would silently dequantize.
        if func is torch.cat and not kwargs and len(args) == 1:
            return concat_rows(list(args[0]))
        return NotImplemented


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    first = parts[0]
    if any((p.group, p.bits, p.offset is None, p.shape[1]) != (first.group, first.bits, first.offset is None,
                                                                 first.shape[1]) for p in parts):  # fmt: skip
        raise ValueError("only quantized weights of one layout concatenate")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])
    sources = {p.source for p in parts}
    return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), offset,
                           first.group, first.bits, sources.pop() if len(sources) == 1 else "requantized")  # fmt: skip


def quantize_int4(values: torch.Tensor) -> QuantizedWeight:
    """Asymmetric 4-bit codes in groups of 32 (Q4_1's scheme): scale (max - min) / 15, offset min."""
    n, k = values.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs a multiple of {INT4_GROUP} inputs, got {k}")
    g = values.float().view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = g.amin(-1), g.amax(-1)
    scale = (high - low) / 15
    codes = torch.round((g - low[..., None]) / scale.clamp_min(1e-30)[..., None]).clamp(0, 15)
    return QuantizedWeight(codes.view(n, k).to(torch.int8), scale, low, INT4_GROUP, 4, "requantized")


def quantize_int8(values: torch.Tensor) -> QuantizedWeight:
    """Symmetric 8-bit codes with one scale per row: max |value| / 127."""
    v = values.float()
    scale = v.abs().amax(1, keepdim=True) / 127
    codes = torch.round(v / scale.clamp_min(1e-30)).clamp(-127, 127)
    return QuantizedWeight(codes.to(torch.int8), scale, None, v.shape[1], 8, "requantized")


def as_format(weight: torch.Tensor | QuantizedWeight, fmt: str) -> QuantizedWeight:
    """`weight` in kernel format `fmt`: its own codes when they already are, else quantized from its values."""
    if isinstance(weight, QuantizedWeight):
        if weight.format == fmt:
            return weight
        weight = weight.dequantize()
    return quantize_int4(weight) if fmt == "int4" else quantize_int8(weight)


# ---- GGUF blocks ---------------------------------------------------------------------------------------

# Bytes of one 32-weight block: fp16 scale (+ fp16 minimum for Q4_1), then the codes.
_Q4_1_BLOCK, _Q8_0_BLOCK = 20, 34
GGUF_TYPES = ("Q4_1", "Q8_0")


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """The codes, scales and offsets of a GGUF tensor's raw blocks [rows, bytes] (ggml's layout:
    a Q4_1 block holds weights 0..15 in the low nibbles of its 16 code bytes and 16..31 in the high)."""
    n, k = shape
    if type_name == "Q4_1":
        blocks = np.ascontiguousarray(raw).reshape(-1, _Q4_1_BLOCK)
        nibbles = blocks[:, 4:]
        codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=1).astype(np.int8)
        offset = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, k // 32))
    elif type_name == "Q8_0":
        blocks = np.ascontiguousarray(raw).reshape(-1, _Q8_0_BLOCK)
        codes, offset = blocks[:, 2:].copy().view(np.int8), None
    else:
        raise ValueError(f"no quantized layout for GGUF type {type_name}")
    scale = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, k // 32))
    bits = 4 if type_name == "Q4_1" else 8
    return QuantizedWeight(torch.from_numpy(codes.reshape(n, k)), scale, offset, 32, bits, type_name)
