"""A decoder layer's parts around attention in one native call each (csrc/layer.cpp): the head (input RMSNorm,
the q/k/v projection, RoPE, the KV row packed) and the tail (attention's output projection and the residual
add, the post-attention RMSNorm, the SwiGLU MLP and its residual add): the ~30 ops and their Python of a
layer outside attention, at two dispatches.

Each is the same registered kernels in the same order as the Python path (tp_groups.RowGroups at TP 1, their
one-call sums; tp_groups.ColumnGroups; ops.rms_norm, ops.rotate and ops.silu_mul natively), the copies and
residual adds torch's: the same bits, by construction; tests/model/test_fused_layer.py compares them. They
exist where every part runs on the native kernels at TP 1 (TP's all-reduces sit between the parts
otherwise); elsewhere the layer runs its Python path.

Each says which layer parts it computes (hicache/model/config.py, LayerParts; `head_accepts`: every head
the families make, Qwen's biases and QK-norm included; `tail_accepts`: Llama's); a layer built from others
(Gemma's output norms or GELU) runs its Python path there, whatever the build.
"""

from __future__ import annotations

import torch

from hicache.model.config import LayerParts
from hicache.model.kernels import native, ops
from hicache.model.kernels.tp_groups import ColumnGroups, RowGroups
from hicache.parallel.parallel import ParallelContext

FORMAT_BITS = {"int4": 4, "int8": 8}


class LayerTail:
    """hidden + down(silu_mul(gate_up(rms_norm(h)))) with h = hidden + o_proj(attn), one call."""

    def __init__(self, o_proj: RowGroups, post_norm: torch.Tensor, eps: float, gate_up: ColumnGroups,
                 down: RowGroups) -> None:  # fmt: skip
        columns = gate_up.calls
        formats = [_bits(o_proj.groups), _bits(columns), _bits(down.groups)]
        self.operands = (_operands(o_proj.groups), post_norm, eps, _operands(columns), gate_up.count,
                         _operands(down.groups), formats)  # fmt: skip
        self._op = native.library().layer_tail

    def __call__(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        o_proj, post_norm, eps, gate_up, groups, down, formats = self.operands
        return self._op(hidden, attn, o_proj, post_norm, eps, gate_up, groups, down, formats)


class LayerHead:
    """(q [T, heads, d], the packed KV rows [T, 2 kv heads d]) of hidden [T, D], as LlamaModel._qkv and
    KVLayout.mha's pack give them from rms_norm(hidden), one call; with the layer's q/k/v biases and QK-norm
    where it has them."""

    def __init__(self, input_norm: torch.Tensor, eps: float, qkv: ColumnGroups, heads: tuple[int, int, int],
                 extras: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]) -> None:  # fmt: skip
        columns = qkv.calls
        self.operands = (input_norm, eps, _operands(columns), _bits(columns), qkv.count, list(heads), *extras)
        self._op = native.library().layer_head

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_norm, eps, qkv, bits, groups, heads, qkv_bias, q_norm, k_norm = self.operands
        return self._op(hidden, input_norm, eps, qkv, bits, groups, heads, cos, sin, qkv_bias, q_norm, k_norm)


class LayerStack:
    """A model's layers, each its head, its attention replayed (native_attention.Replay) and its tail, in one
    native call for the forward pass's layers after the one that ran the key-block plan (csrc/layer.cpp):
    the ops each layer's three calls make, in the same order, so their bits, without ~30 layers' Python and
    dispatches a step. The layers' weights are bound once; a call takes the pool's views (the attention
    backend's `replayed_layers`)."""

    def __init__(self, heads: list[LayerHead], tails: list[LayerTail]) -> None:
        self._stack = getattr(torch.classes, native.LIBRARY).LayerStack()
        for head, tail in zip(heads, tails, strict=True):
            self._stack.add(*head.operands, *tail.operands)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, first: int,
                 replayed: tuple) -> torch.Tensor:  # fmt: skip
        """hidden after layers `first` .. the last, `replayed` the backend's `replayed_layers`."""
        return self._stack.run(hidden, cos, sin, first, *replayed)


def layer_stack(layers: list) -> LayerStack | None:
    """`layers` in one call, where every one has a native head and tail."""
    heads, tails = [layer.head for layer in layers], [layer.tail for layer in layers]
    if not layers or None in heads or None in tails:
        return None
    return LayerStack(heads, tails)


def head_accepts(parts: LayerParts) -> bool:
    """csrc/layer.cpp's head: RMSNorm, one q/k/v projection with or without biases, QK-norm or none, RoPE:
    every head the families' parts make."""
    return True


def tail_accepts(parts: LayerParts) -> bool:
    """csrc/layer.cpp's tail: o_proj and the residual add, RMSNorm, SwiGLU and its residual add; no norms of
    attention's or the MLP's output."""
    return not parts.sandwich_norms and parts.activation == "silu"


def layer_head(layer: object, eps: float, dtype: torch.dtype) -> LayerHead | None:
    """`layer`'s head as one call, where its input norm, q/k/v projection and RoPE all run natively (a
    LlamaLayer's: q | k | v heads of one size a group); None otherwise."""
    qkv, norm = getattr(layer, "qkv_proj", None), getattr(layer, "input_norm", None)
    if not head_accepts(getattr(layer, "parts", LayerParts())):
        return None
    if not isinstance(qkv, ColumnGroups) or norm is None or not _native_rows(norm, dtype):
        return None
    columns = qkv.calls
    if not all(ops.native_one_call(linear) for linear in columns) or _bits(columns) is None:
        return None
    d = layer.head_dim
    if not ops.native_rows_for(dtype, d // 2) or d % 2:
        return None
    extras = (layer.qkv_bias, layer.q_norm, layer.k_norm)
    if any(t is not None and not _native_rows(t, dtype) for t in extras[1:]):
        return None
    return LayerHead(norm, eps, qkv, (layer.q_per_group, layer.kv_per_group, d), extras)


def layer_tail(layer: object, eps: float, pctx: ParallelContext, dtype: torch.dtype) -> LayerTail | None:
    """`layer`'s tail as one call, where its o_proj, post_norm, gate_up and down_proj all run natively at TP 1
    (the Python path's calls are then one kernel each: row groups summed in one call, linears of plans of
    one call at any row count); None otherwise."""
    o_proj, gate_up, down = (getattr(layer, name, None) for name in ("o_proj", "gate_up", "down_proj"))
    post_norm = getattr(layer, "post_norm", None)
    if not tail_accepts(getattr(layer, "parts", LayerParts())):
        return None
    if pctx.tp_size != 1 or not isinstance(o_proj, RowGroups) or not isinstance(down, RowGroups):
        return None
    if not isinstance(gate_up, ColumnGroups) or post_norm is None:
        return None
    if o_proj.summed is None or down.summed is None or not _native_rows(post_norm, dtype):
        return None
    columns = gate_up.calls
    if not all(ops.native_one_call(linear) for linear in columns) or None in (_bits(columns), _bits(o_proj.groups),
                                                                   _bits(down.groups)):  # fmt: skip
        return None
    if (columns[0].out_features * len(columns) // gate_up.count // 2) % 8:  # silu_mul's lanes
        return None
    return LayerTail(o_proj, post_norm, eps, gate_up, down)


def _native_rows(norm: torch.Tensor, dtype: torch.dtype) -> bool:
    return norm.is_cpu and norm.dtype == dtype and ops.native_rows_for(dtype, norm.shape[0])


def _bits(linears: list[ops.Linear]) -> int | None:
    formats = {linear.weight_format for linear in linears}
    return FORMAT_BITS.get(formats.pop()) if len(formats) == 1 else None


def _operands(linears: list[ops.Linear]) -> list[torch.Tensor]:
    return [tensor for linear in linears for tensor in linear.operands]
