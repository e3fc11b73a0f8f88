"""The elementwise parts the model families differ by (hicache/model/config.py, LayerParts): the gated MLP's
activation and soft-capping. Each element is computed by the same arithmetic in any call, so they are
batch-invariant as they stand; SwiGLU goes to ops.silu_mul (natively where it can)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hicache.model.kernels import ops


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated MLP's act(gate) * up of gate_up [T, G, 2C], laid out as ops.silu_mul takes it: [T, G * C].
    `activation`: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with GELU's tanh approximation, Gemma's
    `gelu_pytorch_tanh`)."""
    if activation == "silu":
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).reshape(gate_up.shape[0], -1)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's final logit soft-capping); x itself where cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap
