"""Batch-invariant ops: the one layer through which the model calls GEMM and attention kernels.

The cache invariant needs every token's logits to be independent of how its sequence was cut into
prefill chunks and decode steps, and of which other requests share a step. Kernels choose their
blocking, their code path and their thread split from the problem size, so the same row can round
differently in a 1-row call than in a 2048-row one. Each op below states, in its docstring's first
line after the summary, the mechanism that makes its per-row result independent of the call's shape.
Linear mechanisms are measured on the machine the engine runs on (`calibration.py`); the assembled
model is checked at start-up (`invariance.py`); tests/model/test_batch_invariance.py checks both on
every CPU code path.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hicache.model.kernels import native, quant
from hicache.model.kernels.key_block_attention import block_attention, math_block  # noqa: F401

# oneDNN keeps one primitive per distinct GEMM shape (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep a
# computation cache beside it (LRU_CACHE_CAPACITY), 1024 entries each by default: with prompts of every
# length a server's memory grew in every one of 24 measured rounds of 32 requests (311 -> 701 MB), where 64
# entries hold every shape a steady batch reuses, at no measured cost (docs/RELIABILITY.md, "memory").
KERNEL_CACHE_ENTRIES = "64"
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def configure_device(device: torch.device) -> None:
    """Process-wide kernel settings the invariant needs on `device`, and bounded kernel caches.
    Mechanism: on CUDA, cuBLAS may reduce bf16/fp16 split-K partial sums in reduced precision, and
    TF32 changes float32 products; both are turned off so a GEMM's rounding depends only on its plan.
    The CPU kernel caches are sized before the first kernel runs, which is when they read their size
    (a user's own setting of either variable wins)."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, KERNEL_CACHE_ENTRIES)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cudnn.allow_tf32 = False


# ---- linear ----------------------------------------------------------------------------------------


class LinearBackend:
    """A GEMM implementation for y = x @ W.T: `prepare` turns a weight into what `run` takes, for
    activations of `dtype`. `weight_format` is what it reads: "dense" (a tensor in the activation
    dtype) or a quantized format of hicache/model/kernels/quant.py (a QuantizedWeight in that format)."""

    name = ""
    weight_format = "dense"

    def available(self, dtype: torch.dtype, device: torch.device) -> bool:
        raise NotImplementedError

    def accepts(self, shape: tuple[int, int]) -> bool:
        """Whether the kernel takes a weight of this (out, in) shape."""
        return True

    def prepare(self, weight: Any, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def run(self, prepared: Any, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def bind(self, prepared: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """`run` of `prepared` as one callable (a decode step makes hundreds of calls: what can be looked
        up once is)."""
        return lambda x: self.run(prepared, x)

    def fast_for(self, dtype: torch.dtype) -> bool:
        """Whether the kernel is faster than a dense one for activations of `dtype` (what
        `--quantization auto` asks before keeping a checkpoint's codes)."""
        return True

    def weight_bytes(self, prepared: Any) -> int:
        """Bytes a call reads for the weight (codes, scales and offsets included)."""
        tensors = prepared if isinstance(prepared, tuple) else (prepared,)
        return sum(t.numel() * t.element_size() for t in tensors)


class OneDNNBackend(LinearBackend):
    """oneDNN's matmul on a weight reordered once into its blocked layout (the path inductor uses for
    CPU linears). Measured row-invariant at every row count but 1 for some shapes, and faster than
    MKL at every row count on the SmolLM2 shapes (docs/BENCHMARKS.md)."""

    name = "onednn"

    def available(self, dtype: torch.dtype, device: torch.device) -> bool:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        try:  # bf16 needs AVX512-BF16 or AVX-NE-CONVERT; the reorder says so by raising
            self.run(self.prepare(torch.zeros(8, 8, dtype=dtype), dtype), torch.zeros(2, 8, dtype=dtype))
        except (RuntimeError, AttributeError):
            return False
        return True

    def prepare(self, weight: torch.Tensor, dtype: torch.dtype) -> Any:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def run(self, prepared: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, prepared, None, "none", [], "")


class AtenBackend(LinearBackend):
    """`F.linear`: MKL on CPU float32, oneDNN or ATen's own kernel for CPU bfloat16, cuBLAS on CUDA."""

    name = "aten"

    def available(self, dtype: torch.dtype, device: torch.device) -> bool:
        return True

    def prepare(self, weight: torch.Tensor, dtype: torch.dtype) -> Any:
        return weight

    def run(self, prepared: Any, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, prepared)


class _PackedBackend(LinearBackend):
    """What the two weight-only quantized CPU kernels share: the activations stay in their dtype
    (bf16 is their fast path: with float32 activations they measured 3-40x slower than a dense
    float32 matmul, docs/BENCHMARKS.md section 9), the codes are unpacked inside the kernel."""

    op = ""

    def available(self, dtype: torch.dtype, device: torch.device) -> bool:
        if device.type != "cpu" or not hasattr(torch.ops.aten, self.op):
            return False
        try:
            self.run(self.prepare(quant.as_format(torch.ones(16, 64), self.weight_format), dtype),
                     torch.zeros(2, 64, dtype=dtype))  # fmt: skip
        except RuntimeError:
            return False
        return True

    def fast_for(self, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16


class Int8PackBackend(_PackedBackend):
    """`aten._weight_int8pack_mm`: symmetric int8 codes, one scale per output row."""

    name, weight_format, op = "int8pack", "int8", "_weight_int8pack_mm"

    def prepare(self, weight: "quant.QuantizedWeight", dtype: torch.dtype) -> Any:
        return weight.codes.contiguous(), weight.scale[:, 0].to(dtype).contiguous()

    def run(self, prepared: Any, x: torch.Tensor) -> torch.Tensor:
        codes, scales = prepared
        return torch.ops.aten._weight_int8pack_mm(x, codes, scales)


class Int4PackBackend(_PackedBackend):
    """`aten._weight_int4pack_mm_for_cpu`: 4-bit codes packed two to a byte, a scale and an offset per
    32 inputs in the activation dtype. The kernel computes (code - 8) * scale + zero, so a weight's
    offset m becomes zero = m + 8 * scale."""

    name, weight_format, op = "int4pack", "int4", "_weight_int4pack_mm_for_cpu"
    INNER_K_TILES = 2  # how the packing interleaves K for the kernel's inner loop

    def accepts(self, shape: tuple[int, int]) -> bool:
        n, k = shape
        return n % 16 == 0 and k % quant.INT4_GROUP == 0  # the packing's and the groups' granularity

    def prepare(self, weight: "quant.QuantizedWeight", dtype: torch.dtype) -> Any:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.int(), self.INNER_K_TILES)
        zero = weight.offset + 8 * weight.scale
        return packed, torch.stack([weight.scale, zero], -1).transpose(0, 1).to(dtype).contiguous()

    def run(self, prepared: Any, x: torch.Tensor) -> torch.Tensor:
        packed, scales_and_zeros = prepared
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, quant.INT4_GROUP, scales_and_zeros)


class NativeBackend(LinearBackend):
    """hicache's own weight-only quantized GEMMs (csrc/qgemm.cpp, built by native.py) for float32 and
    bfloat16 activations: each row quantized in groups of 32 inputs to 16-bit integer codes, a group's
    products integer dot products, scaled to float32 once a group; each weight byte read once per call
    at any row count (a panel's step of codes meets every row of x).
    Mechanism: row-invariant by construction, at every row count and thread count: a row's codes depend
    on that row alone, the integer sums are exact, and each output's float steps are one fixed sequence
    (group by group in increasing order) whatever rows share the call; threads split the outputs only.
    The calibration still measures it like any backend (granule 1 passes)."""

    op = ""
    sum_op = ""  # the op of `bind_sum`

    def available(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and native.library() is not None

    def bind_sum(self, prepared: list[Any]) -> Callable[[torch.Tensor], torch.Tensor]:
        """`LinearSum`'s arithmetic as one call: weight g times x's g-th slice of inputs, each rounded to
        x's dtype, the partials summed by `tp_groups.pairwise_sum`, float32 (csrc/qgemm.cpp)."""
        op, operands = getattr(native.library(), self.sum_op), [list(operand) for operand in zip(*prepared)]
        return lambda x: op(x, *operands)

    def accepts(self, shape: tuple[int, int]) -> bool:
        n, k = shape
        return n % native.PANEL == 0 and k % quant.INT4_GROUP == 0  # its panels, and its K loop's unit

    def run(self, prepared: Any, x: torch.Tensor) -> torch.Tensor:
        return getattr(native.library(), self.op)(x, *prepared)

    def bind(self, prepared: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        op = getattr(native.library(), self.op)
        return lambda x: op(x, *prepared)


class NativeInt8Backend(NativeBackend):
    """Symmetric int8 codes [N, K] with one float32 scale per output row."""

    name, weight_format, op, sum_op = "native-int8", "int8", "int8_linear", "int8_linear_sum"

    def prepare(self, weight: quant.QuantizedWeight, dtype: torch.dtype) -> Any:
        return native.int8_operands(weight)


class NativeInt4Backend(NativeBackend):
    """4-bit codes two to a byte in GGUF Q4_1's order (byte j of a 32-input group: inputs j and j + 16),
    a float32 scale and offset per group: value = code * scale + offset, bitwise quant.py's."""

    name, weight_format, op, sum_op = "native-int4", "int4", "int4_linear", "int4_linear_sum"

    def prepare(self, weight: quant.QuantizedWeight, dtype: torch.dtype) -> Any:
        return native.int4_operands(weight)


# Quantized formats list their native kernel first: candidate_plans tries backends in this order.
_ALL = (OneDNNBackend(), AtenBackend(), NativeInt8Backend(), NativeInt4Backend(), Int8PackBackend(), Int4PackBackend())
BACKENDS: dict[str, LinearBackend] = {b.name: b for b in _ALL}


@dataclass(frozen=True)
class LinearPlan:
    """How one weight's GEMM calls are shaped: rows padded to a multiple of `granule`, or (tile > 0)
    cut into tiles of exactly `tile` rows, the last one padded."""

    backend: str
    granule: int = 1
    tile: int = 0

    def describe(self) -> str:
        shape = f"{self.tile}-row tiles" if self.tile else f"rows padded to a multiple of {self.granule}"
        return f"{self.backend}, {shape}"


# Plain F.linear, for benchmarks that measure what invariance costs: not batch-invariant.
PLAIN = LinearPlan("aten", 1)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    # Zero rows: a GEMM's output row depends only on its own input row, so what pads does not matter.
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if rows > x.shape[0] else x


def shaped_call(run: Callable[[torch.Tensor], torch.Tensor], plan: LinearPlan, x: torch.Tensor) -> torch.Tensor:
    """`run` over the rows of x [M, K], with the call shapes `plan` prescribes."""
    m = x.shape[0]
    if plan.tile:
        t = plan.tile
        outs = [run(_pad_rows(x[a : a + t], t))[: min(t, m - a)] for a in range(0, m, t)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    rows = -(-m // plan.granule) * plan.granule
    out = run(_pad_rows(x, rows))
    return out[:m] if rows > m else out


class Linear:
    """y = x @ weight.T with every row's bits independent of how many rows share the call.
    Mechanism: the call shapes of `plan` (padded rows or fixed tiles) on its backend, as measured for
    this weight's shape, format, dtype and platform. `weight`: a tensor in the activation dtype
    `dtype` for a dense backend, a QuantizedWeight in the backend's format for a quantized one."""

    def __init__(self, weight: Any, plan: LinearPlan, dtype: torch.dtype) -> None:
        self.plan = plan
        self.out_features, self.in_features = weight.shape
        self._backend = BACKENDS[plan.backend]
        self._prepared = self._backend.prepare(weight, dtype)
        self._run = self._backend.bind(self._prepared)

    @property
    def weight_format(self) -> str:
        return self._backend.weight_format

    @property
    def weight_bytes(self) -> int:
        return self._backend.weight_bytes(self._prepared)

    @property
    def backend(self) -> LinearBackend:
        return self._backend

    @property
    def operands(self) -> tuple[torch.Tensor, ...]:
        """What the backend's kernel takes for the weight (a native kernel's codes, scales, offsets)."""
        return self._prepared if isinstance(self._prepared, tuple) else (self._prepared,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        if x.dim() == 2 and not plan.tile and x.shape[0] % plan.granule == 0 and x.is_contiguous():
            # Already the call shape the plan prescribes: what shaped_call would run, without its
            # Python (a decode step makes hundreds of these calls; ~15 us each at one row).
            return self._run(x)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        out = shaped_call(self._run, plan, flat.contiguous())
        return out.view(*lead, self.out_features)


class LinearSum:
    """The float32 sum of each linear's product with its slice of x's inputs (equal slices, in order),
    added adjacent pair by adjacent pair (`tp_groups.pairwise_sum`), each product rounded to x's dtype
    first: what a TP rank's row groups add (tp_groups.RowGroups), in one kernel call (`linear_sum`)."""

    def __init__(self, linears: list[Linear]) -> None:
        self._run = linears[0]._backend.bind_sum([linear._prepared for linear in linears])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x)


def native_one_call(linear: Linear) -> bool:
    """Whether `linear` runs on a native quantized kernel in one call of any row count (its plan neither
    pads nor tiles): its op is then what `Linear.__call__` runs, which one native call may run instead."""
    return isinstance(linear.backend, NativeBackend) and not linear.plan.tile and linear.plan.granule == 1


def linear_sum(linears: list[Linear]) -> LinearSum | None:
    """A `LinearSum` of `linears` where their kernel has one (the native quantized ones): the same bits as
    the calls one by one, whose plans are one call of any row count; None otherwise."""
    first = linears[0]
    if not native_one_call(first):
        return None
    if any((lin.plan, lin.out_features, lin.in_features) != (first.plan, first.out_features, first.in_features)
           for lin in linears):  # fmt: skip
        return None
    return LinearSum(linears)


# ---- attention: block_attention.py (re-exported: the model reaches every kernel through this layer) -----


# ---- per-row reductions ------------------------------------------------------------------------------------


def _native_rows(x: torch.Tensor, width: int) -> bool:
    """Whether csrc/rowops.cpp takes rows of `x` `width` wide: on a CPU with the native build, the
    activation dtypes it has, widths a multiple of its 8 lanes (a model's shapes are fixed, so one model
    always takes one path; the family is in its identity, native_attention.attention_family)."""
    return x.is_cpu and native_rows_for(x.dtype, width)


@functools.cache
def native_rows_for(dtype: torch.dtype, width: int) -> bool:
    # Cached: a decode step asks ~150 times, and the answer depends on these two and the build alone.
    return dtype in (torch.float32, torch.bfloat16) and width % 8 == 0 and native.library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 like the reference implementations, then back to the activation dtype.
    Mechanism: a mean over each row alone. Natively (csrc/rowops.cpp) the row's squares are summed in a
    fixed lane order and tree; in torch a row is reduced in an order fixed by its length, and the row
    count only changes how rows are shared among threads."""
    if _native_rows(x, x.shape[-1]):
        if x.dim() == 2 and x.is_contiguous():
            return native.library().rms_norm(x, weight, eps)
        return native.library().rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of gate_up [T, G, 2C] (each group's gate columns, then its up columns):
    [T, G * C]. Mechanism: elementwise, each element by the same arithmetic in any call."""
    if _native_rows(gate_up, gate_up.shape[-1] // 2):
        return native.library().silu_mul(gate_up if gate_up.is_contiguous() else gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up).reshape(gate_up.shape[0], -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in Hugging Face's rotate-half order: x * cos + rotate_half(x) * sin for x [T, heads, dim] and
    cos, sin [T, 1, dim] in x's dtype. Mechanism: elementwise; natively (csrc/rowops.cpp) the same three
    roundings in one call, bit for bit the torch expression."""
    half = x.shape[-1] // 2
    if x.dim() == 3 and _native_rows(x, half):
        return native.library().rope(x if x.is_contiguous() else x.contiguous(), cos, sin)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
