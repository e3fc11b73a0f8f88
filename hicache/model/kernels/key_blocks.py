"""Which kernel calls attend a step's query rows over their keys, block by block (docs/DESIGN.md,
"batch-invariant ops"): the plan `ops.block_attention` runs.

A sequence's keys are cut into blocks of `block` keys at fixed offsets from key 0, and a row attends
over block j in exactly one call whose shape depends only on that row: all `block` keys, unmasked, when
it sees the whole block; else its visible keys rounded up to KV_ALIGN, masked only when it sees fewer
than that (the diagonal). So a row's calls, and the order its block results are combined in, are the
same whether it is a decode step, a row of any prefill chunk, alone or batched. Rows see only blocks
they reach, so a short sequence never pads to a long one, and a call holds at most `block` keys per
sequence: a step's memory is bounded by the block size and its rows, not by context length.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import torch

# CPU flash attention splits keys into blocks of up to 512 and queries into blocks of 32/64/256; a
# short last key block, or a query block of one to three rows, is summed in another order. A call's
# keys are a multiple of KV_ALIGN and its queries (discarded rows) a multiple of Q_ALIGN, so every row
# sees the kernel shapes it would see in any other call.
KV_ALIGN = 512
Q_ALIGN = 8
# Keys a call attends over per sequence (a multiple of KV_ALIGN): larger blocks cost fewer calls, and
# memory of block x rows (docs/BENCHMARKS.md section 14).
KV_BLOCK = 4096
# Rows a call takes from one sequence: a kernel call of 768 rows or more splits queries into 256-row
# blocks, a GEMM shape the invariance tests never measured; at most 512 keeps the 32- and 64-row ones.
Q_PIECE = 512


@dataclass(frozen=True)
class QueryRows:
    """Rows [start, start + len(seen)) of the step's queries, of sequence `seq` (an index the caller's
    reader understands), row i seeing the sequence's first seen[i] keys (non-decreasing)."""

    seq: int
    start: int
    seen: tuple[int, ...]


@dataclass(frozen=True)
class BlockRead:
    """Keys [first, first + length) of each (sequence, first) entry, read as one [E * length] run;
    keys past a sequence's end are masked, so any finite values may stand there."""

    entries: tuple[tuple[int, int], ...]
    length: int


@dataclass
class BlockCall:
    """One kernel call: query rows `rows` [E, n] (an entry's padding repeats its last row) over the
    first `keys` keys of each entry of read `read`; results go to rows `dest` [m], taken from the
    call's flattened [E * n] outputs at `pick` (None: all, in order)."""

    read: int
    keys: int
    rows: torch.Tensor
    dest: torch.Tensor
    pick: torch.Tensor | None
    seen: torch.Tensor | None  # [E, n] keys of the block each row sees, for a masked call (None: all)
    live: torch.Tensor  # [E] each entry's own rows (the rest of its n repeat its last)
    in_order: bool = False  # dest is 0, 1, ... m - 1: the step's first m rows in order

    def covers(self, rows: int) -> bool:
        """Whether its results are a step of `rows` rows' every row, in order (combined whole, not by row)."""
        return self.in_order and self.dest.shape[0] == rows

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask [E, 1, n, keys] as the kernel takes it (0 visible, -inf not, in the queries' dtype).
        Made per call, not kept: a plan's masks would hold a block of keys for every row of the step."""
        if self.seen is None:
            return None
        hidden = torch.arange(self.keys, device=self.seen.device) >= self.seen.unsqueeze(-1)
        additive = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        return additive.masked_fill_(hidden, float("-inf")).unsqueeze(1)


@dataclass
class KeyBlockPlan:
    rows: int  # R: the query rows attended
    reads: list[BlockRead]
    steps: list[list[BlockCall]]  # per key block in order; a step's calls grouped by read
    # The native kernel calls the plan's first layer made (key_block_attention.py), for the next layers.
    native_calls: list[Any] | None = None


@dataclass
class _Entry:
    seq: int
    rows: list[int]
    seen: list[int]  # keys of this block each row sees
    keys: int
    masked: bool


def _entries(q: QueryRows, block: int) -> dict[int, list[_Entry]]:
    """Per block index, the (rows, shape) groups of q's rows, in pieces of at most Q_PIECE rows."""
    out: dict[int, list[_Entry]] = {}
    for a in range(0, len(q.seen), Q_PIECE):
        seen = q.seen[a : a + Q_PIECE]
        rows = range(q.start + a, q.start + a + len(seen))
        # Blocks that every row sees whole (a long context's all but the last): one entry for all of
        # them, so the plan's calls over them share their tensors (`plan`).
        every = seen[0] // block
        if every:
            whole = _Entry(q.seq, list(rows), [block] * len(seen), block, False)
            for j in range(every):
                out.setdefault(j, []).append(whole)
        for j in range(every, (seen[-1] - 1) // block + 1):
            lo = j * block
            full = bisect_left(seen, lo + block)
            i = bisect_right(seen, lo)
            while i < full:  # rows seeing part of the block: one group per (aligned length, masked)
                keys = -(-(seen[i] - lo) // KV_ALIGN) * KV_ALIGN
                stop = bisect_right(seen, lo + keys, i, full)
                if seen[i] - lo < keys:
                    stop = bisect_left(seen, lo + keys, i, stop)
                    masked = True
                else:
                    masked = False
                group = [s - lo for s in seen[i:stop]]
                out.setdefault(j, []).append(_Entry(q.seq, list(rows[i:stop]), group, keys, masked))
                i = stop
            if full < len(seen):
                whole = _Entry(q.seq, list(rows[full:]), [block] * (len(seen) - full), block, False)
                out.setdefault(j, []).append(whole)
    return out


def plan(queries: list[QueryRows], rows: int, device: torch.device, block: int = KV_BLOCK) -> KeyBlockPlan:
    """The calls that attend `queries` (of a step's `rows` query rows) block by block."""
    if block % KV_ALIGN:
        raise ValueError(f"the key block must be a multiple of {KV_ALIGN}, got {block}")
    by_block: dict[int, list[_Entry]] = {}
    for q in queries:
        for j, entries in _entries(q, block).items():
            by_block.setdefault(j, []).extend(entries)
    result = KeyBlockPlan(rows, [], [])
    # The calls of entries already planned, by the entries: a decode batch's whole blocks repeat one
    # group of entries block after block, and a call's tensors depend on its entries alone.
    made: dict[tuple[int, ...], BlockCall] = {}

    def call(read: int, entries: list[_Entry]) -> BlockCall:
        key = tuple(map(id, entries))  # entries live until the plan is made: their ids are theirs
        if key not in made:
            made[key] = _call(read, entries, device)
        return dataclasses.replace(made[key], read=read)

    for j in range(max(by_block, default=-1) + 1):
        lo, step = j * block, []
        # Rows of many sequences (decode steps) share a call per shape; a sequence's multi-row groups
        # share one read of its block, as long as the longest of them needs.
        singles: dict[tuple[int, bool], list[_Entry]] = {}
        longest: dict[int, int] = {}
        for e in by_block.get(j, []):
            if len(e.rows) == 1:
                singles.setdefault((e.keys, e.masked), []).append(e)
            else:
                longest[e.seq] = max(longest.get(e.seq, 0), e.keys)
        read_of = {}
        for seq, length in longest.items():
            read_of[seq] = len(result.reads)
            result.reads.append(BlockRead(((seq, lo),), length))
        for e in by_block.get(j, []):
            if len(e.rows) > 1:
                step.append(call(read_of[e.seq], [e]))
        for (keys, _), group in singles.items():
            result.reads.append(BlockRead(tuple((e.seq, lo) for e in group), keys))
            step.append(call(len(result.reads) - 1, group))
        step.sort(key=lambda c: c.read)
        result.steps.append(step)
    return result


def _call(read: int, entries: list[_Entry], device: torch.device) -> BlockCall:
    n = -(-max(len(e.rows) for e in entries) // Q_ALIGN) * Q_ALIGN
    keys, masked = entries[0].keys, entries[0].masked
    rows = [e.rows + [e.rows[-1]] * (n - len(e.rows)) for e in entries]
    dest = [r for e in entries for r in e.rows]
    pick = [i * n + k for i, e in enumerate(entries) for k in range(len(e.rows))]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    seen = as_tensor([e.seen + [e.seen[-1]] * (n - len(e.seen)) for e in entries]) if masked else None
    whole = len(pick) == len(entries) * n
    live = as_tensor([len(e.rows) for e in entries])
    in_order = dest == list(range(len(dest)))
    return BlockCall(read, keys, as_tensor(rows), as_tensor(dest), None if whole else as_tensor(pick), seen, live,
                     in_order)  # fmt: skip
