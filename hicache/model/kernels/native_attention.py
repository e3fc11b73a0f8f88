"""The native key-block attention kernel (csrc/attention.cpp) as one call of a key-block plan: which calls
it takes, and the operands it wants (docs/DESIGN.md, "batch-invariant ops").

On a CPU with the native build, every call of every plan goes through it, decode and prefill rows alike,
whenever the heads allow (float32 or bfloat16, head sizes a multiple of 8): a model's shapes are fixed,
so one server attends every row with one kernel family, named in its identity (`attention_family`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hicache.model.kernels import key_blocks, native


def attention_family(device: torch.device) -> str:
    """The kernel family that attends (and normalizes, ops.rms_norm / silu_mul) on `device`: a model's
    identity names it, since the native kernels and aten's round differently (KV computed with one is
    never served to the other)."""
    if device.type == "cpu" and native.library() is not None:
        return f"native-attention-v{native.ATTENTION_VERSION}-rows-v{native.ROW_OPS_VERSION}"
    return "aten"


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the native kernel attends these: k and v of q's dtype, or bf16 under float32 q (a
    `--kv-cache-dtype bfloat16` pool, widened exactly as it is read)."""
    kv_ok = k.dtype == v.dtype and (k.dtype == q.dtype or (q.dtype == torch.float32 and k.dtype == torch.bfloat16))
    return q.is_cpu and kv_ok and _takes(q.dtype, q.shape[-1], v.shape[-1])


@functools.cache
def _takes(dtype: torch.dtype, d: int, dv: int) -> bool:
    # Cached: asked twice a layer every step, and the answer depends on these and the build alone.
    return dtype in (torch.float32, torch.bfloat16) and d % 8 == 0 and dv % 8 == 0 and native.library() is not None


@dataclass(frozen=True)
class NativeCalls:
    """Call `call` of a plan over B reads as one kernel call, all of it but the layer's q, k and v: what
    every layer of a forward pass repeats (key_block_attention.py replays it from the second layer on)."""

    call: key_blocks.BlockCall
    reads: tuple[int, ...]  # the plan's reads, in the call's order
    indexes: tuple[torch.Tensor, ...]  # each read's rows of k and v [E * length]
    rows: torch.Tensor  # the call's query rows, flattened [E * n]
    keys: list[torch.Tensor]  # each read's [E, keys] views of its rows (the kernel takes strided rows)
    seen: torch.Tensor


_NONE = torch.empty(0, dtype=torch.int64)  # the kernels' "every row sees all `keys`", "no pick", "every row"


def native_calls(call: key_blocks.BlockCall, reads: list[int], indexes: list[torch.Tensor], length: int) -> NativeCalls:
    """`call` over the reads `reads` whose rows are `indexes` (each [E * length] rows of k and v, in place: a
    pool's layer and its slots)."""
    E = call.rows.shape[0]
    keys = [index.view(E, length)[:, : call.keys] for index in indexes]
    seen = call.seen if call.seen is not None else _NONE
    return NativeCalls(call, tuple(reads), tuple(indexes), call.rows.view(-1), keys, seen)


def attend(calls: NativeCalls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`calls` over keys k [N, Hkv, d] and values v [N, Hkv, dv], in one kernel call: the outputs [B, m, H,
    dv] and log-sum-exps [B, m, H] of the call's rows `call.dest` for each of the B reads. Padding rows are
    not computed. A (row, head)'s result is its own keys' alone whatever the kernel's threads split, so B
    reads in one call give each read's bits alone."""
    call, B = calls.call, len(calls.keys)
    (E, n), H, d = call.rows.shape, q.shape[1], q.shape[2]
    rows = q.index_select(0, calls.rows).view(E, n, H, d)
    out, lse = native.library().block_attend(rows, k, v, calls.keys, calls.seen, call.live, scale)
    out, lse = out.view(B, E * n, H, -1), lse.view(B, E * n, H)
    if call.pick is not None:
        out, lse = out.index_select(1, call.pick), lse.index_select(1, call.pick)
    return out, lse


def combine(top: torch.Tensor, total: torch.Tensor, acc: torch.Tensor, dest: torch.Tensor, outs: torch.Tensor,
            lses: torch.Tensor) -> None:  # fmt: skip
    """Folds block results outs [B, m, H, dv] and lses [B, m, H] into the running combine (top, total [R, H],
    acc [R, H, dv], float32) of rows `dest` [m] (empty: all R rows in order), block 0 first, in place
    (csrc/attention.cpp's `combine_blocks`)."""
    native.library().combine_blocks(top, total, acc, dest, outs.contiguous(), lses.contiguous())


class Replay:
    """A layer of a forward pass whose key-block plan an earlier layer ran, every call in place and native
    (`plan.native_calls`, key_block_attention.py): the step's KV rows written and the recorded calls replayed,
    combined as `_Combined` does, in one native call (csrc/attention.cpp's `replay_attention`): the same ops
    in the same order as the Python replay, so its bits, at one dispatch a layer."""

    def __init__(self, plan: key_blocks.KeyBlockPlan) -> None:
        assert plan.native_calls is not None
        recorded: list[NativeCalls] = plan.native_calls
        single = len(plan.steps) == 1  # `_Combined.single`: the one block's output is the result

        # What `replay_attention` takes after the layer's operands: the calls' rows, keys, reads a call,
        # seen, live, pick and dest, and `single` (csrc/layer.cpp's LayerStack passes them on).
        self.operands = ([c.call.rows for c in recorded], [key for c in recorded for key in c.keys],
                          [len(c.keys) for c in recorded], [c.seen for c in recorded],
                          [c.call.live for c in recorded],
                          [c.call.pick if c.call.pick is not None else _NONE for c in recorded],
                          [_NONE if c.call.covers(plan.rows) else c.call.dest for c in recorded], single)  # fmt: skip
        self._op = native.library().replay_attention

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, dst: torch.Tensor, where: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        """Writes kv [T, w] to dst's rows `where` (dst.index_copy_), then attends q [R, H, d] over k [N, Hkv, d]
        and v [N, Hkv, dv], the pool layer's views, as the plan's recorded calls did: [R, H, dv]."""
        return self._op(q, kv, dst, where, k, v, *self.operands, scale)
