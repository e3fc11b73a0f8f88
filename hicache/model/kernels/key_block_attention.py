"""Attention over a key-block plan (docs/DESIGN.md, "batch-invariant ops"): each call of the plan through
the native kernel (native_attention.py) or aten's, and the blocks' results combined in float32 in block order.
`ops` re-exports `block_attention`: the model reaches it through the ops layer like every kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hicache.model.kernels import key_blocks, native_attention

# Keys [E * length, Hkv, d] and values [E * length, Hkv, dv] of one read of a key-block plan; or keys
# [N, Hkv, d], values [N, Hkv, dv] and the read's rows of them [E * length] (a pool's layer, in place).
ReadBlock = Callable[[int], tuple[torch.Tensor, ...]]
# Blocks one native kernel call may take when a plan repeats a call's rows over consecutive blocks of
# the pool (a decode batch's whole blocks): the kernel's threads then split blocks, each reading whole
# pool rows, instead of one block's KV heads; the bound keeps a step's memory that of a few blocks.
MERGED_BLOCKS = 8
_NO_DEST = torch.empty(0, dtype=torch.int64)  # the native combine's "every row, in order"


def block_attention(q: torch.Tensor, plan: key_blocks.KeyBlockPlan, read: ReadBlock, scale: float) -> torch.Tensor:
    """Attention of query rows q [R, H, d] over their sequences' keys (grouped-query heads): [R, H, dv].
    `read(i)` gives the keys and values of plan.reads[i] (`ReadBlock`). Mechanism: the calls of `plan`
    (key_blocks.py), in which each row meets each key block in a kernel call of a shape fixed by that
    row alone; on a CPU with the native build its kernel serves every call (a row's result is its own
    keys' alone, native_attention.py, so calls repeating one call's rows over several blocks of the pool
    run as one kernel call), else aten's (keys a multiple of KV_ALIGN, queries padded to Q_ALIGN by
    repeating the last, materialized contiguous, never a stride-0 view: its result can depend on the
    strides); the blocks' normalized outputs and log-sum-exps are combined in float32 in block order by
    the same elementwise arithmetic for every row (`_Combined`). Memory: one step's reads at a time (at
    most MERGED_BLOCKS in place), at most a block of keys per sequence."""
    if plan.native_calls is not None:
        replayed = _replay(q, plan, read, scale)
        if replayed is not None:
            return replayed
    combined = _Combined(q, plan)
    native = False  # decided at the first read: whether the native kernel takes these heads
    pending: list[tuple[key_blocks.BlockCall, tuple[torch.Tensor, ...]]] = []  # in-place calls of one shape
    # What each kernel call was, but the layer's q, k and v: replayed by the plan's next layers while every
    # call is an in-place native one (None once one is not).
    recorded: list[native_attention.NativeCalls] | None = []

    def flush() -> None:
        if pending:
            first, (k, v, _) = pending[0]
            calls = native_attention.native_calls(first, [call.read for call, _ in pending],
                                                  [kv[2] for _, kv in pending], plan.reads[first.read].length)
            outs, lses = native_attention.attend(calls, q, k, v, scale)
            combined.add(first, outs, lses, native=True)
            if recorded is not None:
                recorded.append(calls)
            pending.clear()

    for step in plan.steps:
        held, kv = -1, None  # the last read's keys go before the next one is made
        for call in step:
            if call.read != held:
                kv = None
                held, kv = call.read, read(call.read)
                native = native or native_attention.takes(q, kv[0], kv[1])
            assert kv is not None
            if native and len(kv) == 3:  # in place: a call repeating the pending ones' rows joins them
                if pending and not _repeats(pending[0], call, kv, plan):
                    flush()
                pending.append((call, kv))
                if len(pending) == MERGED_BLOCKS:
                    flush()
                continue
            flush()
            recorded = None
            out, lse = _attend_call(q, call, kv, plan.reads[call.read].length, scale, native)
            combined.add(call, out.unsqueeze(0), lse.unsqueeze(0), native)
    flush()
    plan.native_calls = recorded or None
    return combined.result()


def _replay(q: torch.Tensor, plan: key_blocks.KeyBlockPlan, read: ReadBlock, scale: float) -> torch.Tensor | None:
    """`block_attention` by the kernel calls an earlier layer made over the same plan (the same calls, reads
    and combine, in the same order: the same bits), where every read still gives those slots in place and
    each call's reads one pool layer; None where one does not (the caller then runs the plan afresh)."""
    assert plan.native_calls is not None
    combined = _Combined(q, plan)
    for calls in plan.native_calls:
        kvs = [read(i) for i in calls.reads]
        k, v = kvs[0][0], kvs[0][1]
        if any(len(kv) != 3 or kv[2] is not index or kv[0] is not k or kv[1] is not v
               for kv, index in zip(kvs, calls.indexes)):  # fmt: skip
            return None
        outs, lses = native_attention.attend(calls, q, k, v, scale)
        combined.add(calls.call, outs, lses, native=True)
    return combined.result()


def _repeats(first: tuple[key_blocks.BlockCall, tuple[torch.Tensor, ...]], call: key_blocks.BlockCall,
             kv: tuple[torch.Tensor, ...], plan: key_blocks.KeyBlockPlan) -> bool:  # fmt: skip
    """Whether `call` over `kv` is `first`'s call over other slots of the same pool layer."""
    head, (k, v, _) = first
    return (call.rows is head.rows and call.keys == head.keys and kv[0] is k and kv[1] is v
            and plan.reads[call.read].length == plan.reads[head.read].length)  # fmt: skip


class _Combined:
    """The running combine of each row's block results: its maximum log-sum-exp, sum of weights and
    weighted outputs, all float32, updated block by block in block order. A call whose rows are the
    step's rows in order (a decode step's) updates the whole tensors; any other reads and writes its rows
    by index; both compute each element with the same arithmetic. A plan of one block needs no combine:
    the result is the block's output (its weight e^0 = 1 and nothing before it), plus 0.0 as the
    combine's first add would, which makes a -0.0 +0.0."""

    def __init__(self, q: torch.Tensor, plan: key_blocks.KeyBlockPlan) -> None:
        R, H = q.shape[:2]
        self.q, self.rows = q, R
        self.single = len(plan.steps) == 1
        if not self.single:  # a single block's result is its output: nothing to combine
            self.top = q.new_full((R, H), float("-inf"), dtype=torch.float32)
            self.total = q.new_zeros((R, H), dtype=torch.float32)
        self.acc: torch.Tensor | None = None
        self.out: torch.Tensor | None = None  # the one block's output, when single

    def add(self, call: key_blocks.BlockCall, outs: torch.Tensor, lses: torch.Tensor, native: bool) -> None:
        """Folds block results outs [B, m, H, dv] and lses [B, m, H] of the call's rows in, block 0 first:
        with the native kernel's combine when `native` (its exp, so its own attention family), else in
        torch ops."""
        whole = call.covers(self.rows)
        if self.single:
            out = outs[0]
            if whole:
                self.out = out + 0.0
                return
            if self.out is None:
                self.out = out.new_empty((self.rows, *out.shape[1:]))
            self.out.index_copy_(0, call.dest, out + 0.0)
            return
        if self.acc is None:
            self.acc = outs.new_zeros((self.rows, *outs.shape[2:]), dtype=torch.float32)
        if native:
            dest = _NO_DEST if whole else call.dest
            native_attention.combine(self.top, self.total, self.acc, dest, outs, lses)
            return
        for out, lse in zip(outs, lses):
            self._add(call.dest, whole, out, lse)

    def _add(self, dest: torch.Tensor, whole: bool, out: torch.Tensor, lse: torch.Tensor) -> None:
        assert self.acc is not None
        before = self.top if whole else self.top.index_select(0, dest)
        now = torch.maximum(before, lse)
        kept, added = torch.exp(before - now), torch.exp(lse - now)
        weighted = out.float() * added.unsqueeze(-1)
        if whole:
            self.acc = self.acc * kept.unsqueeze(-1) + weighted
            self.total = self.total * kept + added
            self.top = now
            return
        self.acc.index_copy_(0, dest, self.acc.index_select(0, dest) * kept.unsqueeze(-1) + weighted)
        self.total.index_copy_(0, dest, self.total.index_select(0, dest) * kept + added)
        self.top.index_copy_(0, dest, now)

    def result(self) -> torch.Tensor:
        if self.single and self.out is not None:
            return self.out
        if self.acc is None:
            return self.q.new_zeros(self.q.shape)
        return (self.acc / self.total.unsqueeze(-1)).to(self.q.dtype)


def _attend_call(
    q: torch.Tensor, call: key_blocks.BlockCall, kv: tuple[torch.Tensor, ...], length: int, scale: float, native: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of a key-block plan over its read `kv` (entries of `length` keys) with the native kernel
    or aten's: the output [m, H, dv] and log-sum-exp [m, H] of its rows `call.dest`."""
    k, v = kv[0], kv[1]
    if native:
        index = torch.arange(k.shape[0], device=q.device)
        outs, lses = native_attention.attend(native_attention.native_calls(call, [call.read], [index], length), q, k,
                                             v, scale)  # fmt: skip
        return outs[0], lses[0]
    if len(kv) == 3:
        k, v = k.index_select(0, kv[2]), v.index_select(0, kv[2])
    k, v = k.to(q.dtype), v.to(q.dtype)  # a bf16 pool under float32 queries: widened exactly
    (E, n), H, d = call.rows.shape, q.shape[1], q.shape[2]
    k, v = (t.unflatten(0, (E, length))[:, : call.keys].transpose(1, 2) for t in (k, v))
    rows = q.index_select(0, call.rows.view(-1)).view(E, n, H, d).transpose(1, 2).contiguous()
    out, lse = _block_kernel(rows, k, v, call.additive_mask(q.dtype), scale)
    out, lse = out.transpose(1, 2).reshape(E * n, H, -1), lse.transpose(1, 2).reshape(E * n, H)
    if call.pick is not None:
        out, lse = out.index_select(0, call.pick), lse.index_select(0, call.pick)
    return out, lse


def _block_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block call: the normalized output [E, H, n, dv] and the float32 log-sum-exp [E, H, n]."""
    if q.device.type != "cpu":
        return math_block(q, k, v, mask, scale)
    # The CPU kernel takes one head size: zero columns widen the narrower side (MLA's values are narrower
    # than its keys), adding nothing to a score and giving output columns that are dropped.
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=scale)  # fmt: skip
    return out[..., :dv], lse


def math_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_block_kernel` in plain float32 tensor ops, where no kernel returns a log-sum-exp for a masked
    call (its scores [E, H, n, keys] are bounded by the block)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float()
    scores = q.float() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = scores.logsumexp(-1)
    return ((scores - lse.unsqueeze(-1)).exp() @ v).to(q.dtype), lse
