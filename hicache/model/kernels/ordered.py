"""Batch-invariant ops of a hybrid model's layers (docs/DESIGN.md, "hybrid models"), built from elementwise
arithmetic whose reductions run in one fixed order.

Sliding-window attention reads a fixed number of keys per row (the window), and the gated recurrence of a
linear-attention layer is a per-sequence scan: neither needs a GEMM, and a GEMM or torch's own reductions
would choose their summation order from the call's shape. Here every sum is a chain of elementwise adds
in index order (`ordered_sum`), every product elementwise, a maximum is exact in any order, and exp and
sigmoid run on whole vectors (`whole_vectors`); so a row's result is the same bits whatever rows,
sequences or chunks share the call.
"""

from __future__ import annotations

from typing import Callable

import torch


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of x over `dim`, slice 0 + slice 1 + ... in that order.
    Mechanism: elementwise adds only, so no kernel picks a blocking or a tree from the tensor's shape."""
    parts = x.unbind(dim)
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


# Elements a vectorized elementwise kernel takes per iteration, at most (two AVX-512 vectors of float32):
# the remainder past its last whole iteration goes through the kernel's scalar path, whose exp may round
# another way, so which path an element takes would depend on the size of the call it is in.
VECTOR_SPAN = 32


def whole_vectors(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn (elementwise: exp, sigmoid) of x, computed on x flattened and zero-padded to a multiple of
    VECTOR_SPAN elements. Mechanism: every element goes through the kernel's vectorized body, whatever
    the call's size."""
    flat = x.reshape(-1)
    pad = -flat.numel() % VECTOR_SPAN
    out = fn(torch.cat([flat, flat.new_zeros(pad)]) if pad else flat)
    return (out[: flat.numel()] if pad else out).view(x.shape)


def window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Each row's attention over its own window of keys (grouped-query heads): q [T, H, d], keys
    k [T, W, Hkv, d], values v [T, W, Hkv, dv], `visible` [T, W] (False: before the sequence's start);
    returns [T, H, dv] in q's dtype.
    Mechanism: scores, softmax and the weighted sum in float32 with `ordered_sum` over d and over the
    window; the softmax's maximum is exact; a row reads only its own W keys."""
    T, H, d = q.shape
    W, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = H // kv_heads
    qf = q.float().view(T, 1, kv_heads, group, d)
    scores = ordered_sum(qf * k.float().unsqueeze(3), dim=-1) * scale  # [T, W, Hkv, G]
    scores = scores.masked_fill(~visible.view(T, W, 1, 1), float("-inf"))
    weights = whole_vectors(torch.exp, scores - scores.amax(dim=1, keepdim=True))
    total = ordered_sum(weights, dim=1)  # [T, Hkv, G]
    out = ordered_sum(weights.unsqueeze(-1) * v.float().unsqueeze(3), dim=1)  # [T, Hkv, G, dv]
    return (out / total.unsqueeze(-1)).reshape(T, H, dv).to(q.dtype)


def gated_scan(
    state: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gates: torch.Tensor, stored: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The gated linear-attention recurrence S_t = g_t * S_{t-1} + k_t v_t^T of N sequences in lockstep:
    state [N, H, dk, dv] (float32) before step 0, keys [N, S, H, dk], values [N, S, H, dv], gates
    [N, S, H]; returns the state after every step, [N, S, H, dk, dv] float32. A step of a sequence shorter
    than S is padding: gate 1 and key 0 leave its state as it was. Where `stored` [N, S] is True the state
    after that step is rounded to `dtype`, as a snapshot of it is stored: a run that restores the
    snapshot and one that computed through it then continue from the same bits.
    Mechanism: per step one elementwise multiply-add per state element, in step order; nothing reduces."""
    N, S = keys.shape[:2]
    out = state.new_empty((N, S, *state.shape[1:]))
    keys, values, gates = keys.float(), values.float(), gates.float()
    rounds = dtype != torch.float32
    for t in range(S):
        state = state * gates[:, t, :, None, None] + keys[:, t, :, :, None] * values[:, t, :, None, :]
        if rounds:
            state = torch.where(stored[:, t, None, None, None], state.to(dtype).float(), state)
        out[:, t] = state
    return out


def state_readout(q: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """o_t = q_t S_t per head: q [T, H, dk], states [T, H, dk, dv] -> [T, H, dv] in q's dtype.
    Mechanism: `ordered_sum` over dk."""
    return ordered_sum(q.float().unsqueeze(-1) * states, dim=2).to(q.dtype)
