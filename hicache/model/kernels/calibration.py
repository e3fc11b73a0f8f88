"""Measures, on the machine the engine runs on, which call shape makes each linear layer row-invariant.

For a weight shape, a candidate plan (backend + row granule, or fixed tiles) passes when every call
of 1 to 16 rows, at two offsets into a 64-row reference call, and the first rows of a large
odd-sized call give bit for bit the rows of the reference call, on operands built so that any
change of summation order shows in the output. Candidates are tried in order of speed: oneDNN on a
reordered weight, then `F.linear`, each with the smallest granule in GRANULES that passes, then
fixed TILE-row tiles. A quantized weight (int8/int4 codes) is planned on its format's kernel alone,
with probe codes built the same way (`probe_quantized`): one kernel serves it at every row count.
What was found is kept in a JSON file per platform fingerprint (torch build, CPU or GPU model, the ISA and
reproducibility variables that steer MKL and oneDNN, thread count, the native kernels' version), so a restart does not measure again;
the start-up self-check still verifies the assembled model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import platform
import tempfile
from dataclasses import asdict

import torch

from hicache.model.kernels import native, quant
from hicache.model.kernels.cache_dir import default_cache_dir
from hicache.model.kernels.ops import BACKENDS, LinearPlan, shaped_call

logger = logging.getLogger(__name__)

GRANULES = (1, 2, 4, 8, 16)
TILE = 64
REFERENCE_ROWS = 64
SMALL_ROWS = range(1, 17)
OFFSETS = (0, 37)  # an odd offset puts a row at another position of its call than in the reference
LARGE_ROWS = 517  # an odd count: the large-call kernels and their remainder handling
# Environment variables that change which kernels MKL and oneDNN run.
NUMERICS_ENV = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "MKL_DEBUG_CPU_TYPE",
    "ONEDNN_MAX_CPU_ISA",
)


class NoInvariantPlan(RuntimeError):
    """No candidate call shape made this weight's GEMM row-invariant on this machine."""


def _device_model(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} sm{props.major}{props.minor}"
    model, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key == "model name" and not model:
                    model = line.split(":", 1)[1].strip()
                elif key == "flags":
                    flags = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} {hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def platform_fingerprint(device: torch.device) -> str:
    parts = {
        "torch": torch.__version__,
        "build": getattr(torch.version, "git_version", ""),
        "device": _device_model(device),
        "capability": torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else "",
        "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k, "") for k in NUMERICS_ENV},
        # Which native kernels exist: plans found without them (or with another version) are not reused.
        "native": native.VERSION if device.type == "cpu" and native.library() is not None else 0,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


PAIRS = 4  # cancelling pairs of large products per output (see probe_operands)


def probe_operands(n: int, k: int, rows: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A weight [n, k] and inputs [rows, k] on which any change of summation order shows.

    With plain random data a bf16 output hides most of it: the fp32 accumulators of two orders
    differ by ~2^-24 relative, the output keeps 8 bits, so only one output in ~10^4 rounds
    differently. Here each output also sums PAIRS pairs of products of +-2^21 that cancel exactly:
    the partial sums swing through 2^21, where an fp32 rounding step (2^-3) is as large as a bf16
    step of the small final result, so a different order changes nearly every output. Powers of two
    are exact in every dtype, so both orders compute the same exact value; only rounding differs."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    quarter = max(k // 4, 1)
    for i in range(min(PAIRS, quarter)):
        lo, hi = i * quarter // PAIRS, k - 1 - i * quarter // PAIRS  # far apart: different blocks
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        weight[:, lo] = weight[:, hi] = sign * 2.0**10
        x[:, lo], x[:, hi] = 2.0**11, -(2.0**11)
    return weight.to(device=device, dtype=dtype), x.to(device=device, dtype=dtype)


def probe_quantized(n: int, k: int, rows: int, fmt: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """`probe_operands` for a quantized format: random codes with a power-of-two scale per row (so
    every dequantized value is exact, in the kernel as here), and PAIRS cancelling pairs made of the
    largest code in two far-apart groups of a row (equal scales, so equal values) against inputs
    +-2^e, with 2^e sized so the products are ~2^16 times the random part of the output."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-1, 2, (n, 1), generator=gen).float()
    if fmt == "int4":
        codes, top = torch.randint(0, 16, (n, k), generator=gen), 15
        weight = quant.QuantizedWeight(codes.to(torch.int8), scale.expand(n, k // quant.INT4_GROUP).contiguous(),
                                       torch.zeros(n, k // quant.INT4_GROUP), quant.INT4_GROUP, 4, "probe")  # fmt: skip
    else:
        codes, top = torch.randint(-127, 128, (n, k), generator=gen), 127
        weight = quant.QuantizedWeight(codes.to(torch.int8), scale, None, k, 8, "probe")
    x = torch.randn(rows, k, generator=gen)
    typical = (x[:REFERENCE_ROWS] @ weight.dequantize().t()).abs().median().item()
    big = 2.0 ** round(math.log2(max(typical, 1e-3) * 2**16 / top))
    quarter = max(k // 4, 1)
    for i in range(min(PAIRS, quarter)):
        lo, hi = i * quarter // PAIRS, k - 1 - i * quarter // PAIRS
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1, 1) if fmt == "int8" else 1
        weight.codes[:, lo] = weight.codes[:, hi] = (sign * top) if fmt == "int8" else top
        x[:, lo], x[:, hi] = big, -big
    return weight, x.to(device=device, dtype=dtype)


def probe_for(shape: tuple[int, int], fmt: str, dtype: torch.dtype, device: torch.device):
    """The probe weight (in what a `fmt` backend prepares from) and inputs for one weight shape."""
    if fmt == "dense":
        return probe_operands(*shape, LARGE_ROWS, dtype, device)
    return probe_quantized(*shape, LARGE_ROWS, fmt, dtype, device)


def plan_passes(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, plan: LinearPlan) -> bool:
    """True if every probe call shaped by `plan` gives the reference call's rows bit for bit."""
    backend = BACKENDS[plan.backend]
    weight, x = probe_for(shape, backend.weight_format, dtype, device)
    prepared = backend.prepare(weight, dtype)

    def call(rows: torch.Tensor) -> torch.Tensor:
        return shaped_call(lambda r: backend.run(prepared, r), plan, rows.contiguous())

    ref = call(x[:REFERENCE_ROWS])
    if not torch.equal(call(x)[:REFERENCE_ROWS], ref):
        return False
    for m in SMALL_ROWS:
        for off in OFFSETS:
            if not torch.equal(call(x[off : off + m]), ref[off : off + m]):
                return False
    return True


def rows_stack(shape: tuple[int, int], count: int, dtype: torch.dtype, device: torch.device, alone: LinearPlan,
               stacked: LinearPlan) -> bool:  # fmt: skip
    """True if one call of `count` weights of `shape` stacked by rows (planned `stacked`) gives each
    weight's outputs bit for bit as its own call (planned `alone`) does. Both plans are row-invariant
    on their own, so one large odd-sized call on probe operands stands for every row count; the
    probe's cancelling pairs show a change of summation order, and its columns span every position
    of the stacked call's column blocks."""
    n, k = shape
    fused_backend, backend = BACKENDS[stacked.backend], BACKENDS[alone.backend]
    weight, x = probe_for((count * n, k), fused_backend.weight_format, dtype, device)
    fused_weight = fused_backend.prepare(weight, dtype)
    fused = shaped_call(lambda r: fused_backend.run(fused_weight, r), stacked, x)
    for g in range(count):
        part = weight[g * n : (g + 1) * n]
        prepared = backend.prepare(part.contiguous() if isinstance(part, torch.Tensor) else part, dtype)
        if not torch.equal(shaped_call(lambda r: backend.run(prepared, r), alone, x), fused[:, g * n : (g + 1) * n]):
            return False
    return True


def candidate_plans(dtype: torch.dtype, device: torch.device, weight_format: str = "dense") -> list[LinearPlan]:
    """Backends reading `weight_format`, each with every granule, then fixed tiles (on ATen's dense
    kernel, or on the format's first backend)."""
    plans = [
        LinearPlan(name, g)
        for name, backend in BACKENDS.items()
        if backend.weight_format == weight_format and backend.available(dtype, device)
        for g in GRANULES
    ]
    if weight_format == "dense":
        return plans + [LinearPlan("aten", tile=TILE)]
    return plans + [LinearPlan(plans[0].backend, tile=TILE)] if plans else []


class LinearPlanner:
    """Finds (and remembers) the plan of each weight shape for one device and dtype.

    NOTE: a plan is a property of the shape, dtype and platform, not of the weight's values: kernels
    choose their code path from shapes and strides, so it is measured on synthetic operands that
    make any change of summation order visible (`probe_operands`)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, cache_dir: pathlib.Path | None = None) -> None:
        self.device = device
        self.dtype = dtype
        self.fingerprint = platform_fingerprint(device)
        self.path = (cache_dir or default_cache_dir()) / f"linear-plans-{self.fingerprint}.json"
        self._plans: dict[str, LinearPlan] = self._load()
        self._candidates: dict[str, list[LinearPlan]] = {}
        self._stacks: dict[tuple[tuple[int, int], int, str], bool] = {}

    def _key(self, shape: tuple[int, int], weight_format: str) -> str:
        n, k = shape
        fmt = "" if weight_format == "dense" else f"{weight_format}:"  # dense keys predate formats
        return f"{str(self.dtype).removeprefix('torch.')}:{fmt}{n}x{k}"

    def plan(self, shape: tuple[int, int], weight_format: str = "dense") -> LinearPlan:
        """The plan of a weight of `shape` (out, in) stored in `weight_format`."""
        key = self._key(tuple(shape), weight_format)
        if key not in self._plans:
            self._plans[key] = self._measure(tuple(shape), weight_format, key)
            self._save()
        return self._plans[key]

    def _measure(self, shape: tuple[int, int], weight_format: str, key: str) -> LinearPlan:
        if weight_format not in self._candidates:
            self._candidates[weight_format] = candidate_plans(self.dtype, self.device, weight_format)
        candidates = self._candidates[weight_format]
        for plan in candidates:
            if plan_passes(shape, self.dtype, self.device, plan):
                logger.info("linear %s on %s: %s", key, self.device, plan.describe())
                return plan
        raise NoInvariantPlan(
            f"no batch-invariant call shape found for a {key} linear on this machine "
            f"(tried {', '.join(p.describe() for p in candidates) or 'nothing: no kernel for this format'})"
        )

    def rows_stack(self, shape: tuple[int, int], count: int, weight_format: str = "dense") -> bool:
        """Whether `count` weights of `shape` stacked by rows may run as one call: each one's outputs
        are then bit for bit those of its own call (`rows_stack`; measured once per process)."""
        key = (tuple(shape), count, weight_format)
        if key not in self._stacks:
            n, k = shape
            alone, stacked = self.plan(shape, weight_format), self.plan((count * n, k), weight_format)
            self._stacks[key] = rows_stack(shape, count, self.dtype, self.device, alone, stacked)
            how = "as one call" if self._stacks[key] else "in separate calls (one call rounds otherwise)"
            logger.info("linear %dx %s stacked %s: %s", count, self._key(shape, weight_format), how, stacked.describe())
        return self._stacks[key]

    def forget(self) -> None:
        """Measure again from scratch (after a self-check failed with remembered plans)."""
        self._plans = {}
        self.path.unlink(missing_ok=True)

    def _load(self) -> dict[str, LinearPlan]:
        try:
            raw = json.loads(self.path.read_text())
            return {key: LinearPlan(**fields) for key, fields in raw.items() if fields["backend"] in BACKENDS}
        except (OSError, ValueError, TypeError, KeyError):
            return {}  # absent or unreadable: measure again

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump({key: asdict(plan) for key, plan in self._plans.items()}, f, indent=1, sort_keys=True)
            os.replace(f.name, self.path)
        except OSError as exc:  # a read-only home only costs a re-measurement next time
            logger.warning("could not save linear plans to %s: %s", self.path, exc)
