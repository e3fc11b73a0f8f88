"""Builds one rank's decoder on its batch-invariant ops, and checks the invariant on this machine.

Each linear weight becomes a matmul in the engine's weight format (`--quantization`: dense, or kept
as int8/int4 codes for the weight-only quantized kernels); its call shapes are measured per weight
shape and format (kernels/calibration.py, remembered across restarts); the assembled model then runs the
start-up probe (kernels/invariance.py) and carries its report as `model.invariance`. If the probe fails with
remembered plans, they are measured again once: a stale file must not stand between a user and the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

import torch

from hicache.errors import UserError
from hicache.model.config import LoadedModel
from hicache.model.families.llama import LlamaModel, MakeLinear
from hicache.model.families.registry import family_of
from hicache.model.kernels import native, native_attention, ops, quant
from hicache.model.kernels.calibration import LinearPlanner, NoInvariantPlan
from hicache.model.kernels.invariance import InvarianceReport, mechanisms, self_check
from hicache.parallel.parallel import ParallelContext
from hicache.parallel.placement import kv_sharding

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint"  # each weight in its checkpoint's own format: Q4_1 -> int4, Q8_0 -> int8, else dense


def kernel_available(fmt: str, dtype: torch.dtype, device: torch.device, fast: bool = False) -> bool:
    """Whether some backend runs weights of format `fmt` with `dtype` activations on `device` (`fast`:
    and is faster there than a dense kernel)."""
    return any(b.weight_format == fmt and b.available(dtype, device) and (b.fast_for(dtype) or not fast)
               for b in ops.BACKENDS.values())  # fmt: skip


def resolve_quantization(requested: str, loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> str:
    """What `--quantization` means for this checkpoint, dtype and device: none, int8, int4 or checkpoint.

    auto keeps the checkpoint's quantized tensors quantized where a kernel is fast (`fast_for`): aten's
    packed kernels with bfloat16 activations, hicache's native kernels (kernels/native.py) with either
    dtype. With float32 activations (where bf16 is not native, e.g. AVX2-only CPUs) the packed kernels
    measured 3-40x slower than a dense float32 matmul, so without the native ones auto stays dense there."""
    if requested not in quant.QUANTIZATIONS:
        raise UserError(f"--quantization must be one of {', '.join(quant.QUANTIZATIONS)}, got {requested!r}")
    if requested == "none":
        return "none"
    if requested in quant.FORMATS:
        if not kernel_available(requested, dtype, device):
            raise UserError(f"--quantization {requested}: no {requested} weight-only kernel for "
                            f"{str(dtype).removeprefix('torch.')} on {device.type} in this torch build")  # fmt: skip
        return requested
    formats = weight_formats(requested, loaded)
    if not formats or not all(kernel_available(f, dtype, device, fast=True) for f in formats):
        return "none"
    return CHECKPOINT


def weight_formats(requested: str, loaded: LoadedModel) -> set[str]:
    """The quantized formats `--quantization requested` would keep `loaded`'s linear weights in, where a
    kernel for them runs (empty: every weight dense)."""
    if requested == "none":
        return set()
    if requested in quant.FORMATS:
        return {requested}
    return {w.kernel_format for w in loaded.quantized.values()}


def with_weight_format(loaded: LoadedModel, resolved: str, device: torch.device) -> LoadedModel:
    """`loaded` to be built in weight format `resolved`. Another format computes other KV, so it gets
    another identity (storage keys and P/D peers are namespaced by it); dense keeps the file's. So do
    the quantized formats' two kernel families on a CPU: hicache's native kernels and aten's packed ones
    (where the native build failed) round differently, and a server of each must not share KV."""
    on_native = device.type == "cpu" and native.library() is not None
    kernels = f":native-v{native.VERSION}" if on_native else ""
    identity = loaded.identity if resolved == "none" else hashlib.sha256(
        f"{loaded.identity}:weights-{resolved}{kernels}".encode()).hexdigest()  # fmt: skip
    # Which passes multiply them, for /health and the start-up line: the ISA does not enter the identity,
    # since every ISA's passes compute the same bits (csrc/qgemm.cpp's header).
    runs_on = "dense" if resolved == "none" else f"native {native.library().kernel_isa()}" if on_native else "aten"
    return dataclasses.replace(loaded, identity=identity,
                               extra={**loaded.extra, "weight_format": resolved, "weight_kernels": runs_on})  # fmt: skip


def with_attention_family(loaded: LoadedModel, device: torch.device) -> LoadedModel:
    """`loaded` with an identity naming the kernel family its attention runs on here: the native kernel
    (csrc/attention.cpp) and aten's flash kernel round differently, so KV computed with one must never be
    served (storage keys) or sent (P/D peers) to a server attending with the other. aten's keeps the
    identity it had."""
    family = native_attention.attention_family(device)
    if family == "aten":
        return loaded
    identity = hashlib.sha256(f"{loaded.identity}:attention-{family}".encode()).hexdigest()
    return dataclasses.replace(loaded, identity=identity)


class LinearFactory:
    """Turns one checkpoint weight (float32 values, or a QuantizedWeight: what the loader kept) into
    a batch-invariant matmul in the resolved weight format (`MakeLinear`). A weight whose shape the
    format's kernel does not take stays dense (logged once per shape)."""

    def __init__(self, resolved: str, dtype: torch.dtype, device: torch.device, planner: LinearPlanner | None) -> None:
        self.resolved, self.dtype, self.device, self.planner = resolved, dtype, device, planner
        self._dense_shapes: set[tuple[int, int]] = set()

    def format_for(self, weight: Any) -> str:
        if self.resolved == "none":
            return "dense"
        if self.resolved == CHECKPOINT:
            if not isinstance(weight, quant.QuantizedWeight):
                return "dense"
            fmt = weight.kernel_format
        else:
            fmt = self.resolved
        shape = tuple(weight.shape)
        if not all(b.accepts(shape) for b in ops.BACKENDS.values() if b.weight_format == fmt):
            if shape not in self._dense_shapes:
                logger.info("linear %dx%d stays dense: the %s kernel does not take that shape", *shape, fmt)
                self._dense_shapes.add(shape)
            return "dense"
        return fmt

    def stacked(self, weights: list[Any]) -> ops.Linear | None:
        """One matmul of `weights` (of one shape) stacked by rows, where each one's outputs are bit for
        bit those of its own matmul; None where they are not (its own calls are then needed)."""
        fmt = self.format_for(weights[0])
        if self.planner is not None and not self.planner.rows_stack(tuple(weights[0].shape), len(weights), fmt):
            return None  # measured once per shape; no copy of the weights for a refusal
        whole = torch.cat(weights)
        return self(whole) if self.format_for(whole) == fmt else None

    def __call__(self, weight: Any) -> ops.Linear:
        fmt = self.format_for(weight)
        if fmt == "dense":
            prepared = weight.to(device=self.device, dtype=self.dtype).contiguous()
        else:
            prepared = quant.as_format(weight, fmt)
        if self.planner is not None:
            plan = self.planner.plan(tuple(prepared.shape), fmt)
        else:  # plain ops, for benchmarks of what invariance costs
            plan = ops.PLAIN if fmt == "dense" else ops.LinearPlan(_first_backend(fmt, self.dtype, self.device), 1)
        return ops.Linear(prepared, plan, self.dtype)


def _first_backend(fmt: str, dtype: torch.dtype, device: torch.device) -> str:
    return next(name for name, b in ops.BACKENDS.items() if b.weight_format == fmt and b.available(dtype, device))


def build_decoder(
    loaded: LoadedModel, pctx: ParallelContext, dtype: torch.dtype, device: torch.device, invariant: bool = True
) -> LlamaModel:
    """`invariant=False` builds the model on plain `F.linear` without padding, for benchmarks that
    measure what invariance costs; it is not checked (its report says so). The weight format is
    `loaded.extra["weight_format"]` (`with_weight_format`; dense when absent)."""

    ops.configure_device(device)
    decoder = family_of(loaded).decoder
    sharding = kv_sharding(pctx, decoder.replicated_over_tp)
    resolved = str(loaded.extra.get("weight_format", "none"))
    weights = loaded.weights if resolved == "none" else {**loaded.weights, **loaded.quantized}

    def build(make_linear: MakeLinear) -> LlamaModel:
        return decoder(loaded.config, weights, pctx, dtype, device, make_linear, sharding)

    if not invariant:
        model = build(LinearFactory(resolved, dtype, device, None))
        model.invariance = InvarianceReport(False, mechanisms(model), "plain ops (benchmark mode): not checked")
        return model
    planner = LinearPlanner(device, dtype)
    remembered = planner.path.exists()
    try:
        model = build(LinearFactory(resolved, dtype, device, planner))
    except NoInvariantPlan as exc:
        model = build(LinearFactory("none", dtype, device, None))
        model.invariance = InvarianceReport(False, mechanisms(model), str(exc))
        return model
    model.invariance = self_check(model)
    # Only at one TP rank: TP ranks probe in lockstep (the sums are collectives), and whether a
    # plan file was there when each rank started is not something they agree on.
    if not model.invariance.verified and remembered and pctx.tp_size == 1:
        planner.forget()
        model = build(LinearFactory(resolved, dtype, device, planner))
        model.invariance = self_check(model)
    return model
