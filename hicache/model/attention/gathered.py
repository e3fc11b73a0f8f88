"""The CP-gathered attention backend (docs/DESIGN.md, "attention backends" and "CP page sharding"):
attention over KV pages sharded across a group of ranks (hicache/parallel/placement.py), for context
parallelism and for MLA's latent KV over attention-TP ranks.

Token assignment (CP): **interleaved**: row i of the step's flattened batch is computed by CP rank
i mod N. Zigzag (2N blocks, rank r taking blocks r and 2N-1-r) exists to balance causal attention
while keeping each rank's queries contiguous, which matters to ring attention, where a rank's KV
blocks travel around the ring. Here every rank attends over the whole gathered KV, so contiguity buys
nothing, and interleaving is at least as balanced for every step: the ranks' row counts (GEMM work)
differ by at most one, each rank's queries spread evenly over a prefill's positions (causal attention
work within about one row's keys of the others'), decode steps of many requests are shared out too,
and it needs no minimum chunk length. (The assignment cannot change an answer: every op's per-row
result is independent of which other rows share its call, hicache/model/kernels/ops.py.)

Per layer, each rank computes q and the packed KV rows of its own rows; the step's KV rows are
all-gathered in row order (a concatenation, no arithmetic), each rank writes the ones whose pages it
owns into its pool, and a sequence's keys are its prefix (gathered pages, hicache/model/attention/kv_gather.py,
mapped to logical order) followed by the step's rows, in position order: exactly the keys and values
the single-rank run attends over, so attention is computed over the full KV and no cross-rank float
sum enters any result (batch invariance holds, and a CP run equals the single-rank run bit for bit).
After the last layer the ranks' rows are all-gathered back into the batch's order (`collect`).

MLA over attention TP (no token split): every TP rank computes every row's latent KV (it is
replicated), keeps the pages it owns, and gathers the prefix pages the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hicache.mem.device_pool import DeviceKVPool, OwnedSlots
from hicache.model.attention.backends import Expand, step_queries
from hicache.model.attention.kv_gather import GatherPlan, GatherStats, PrefixGather, ScratchBuffers
from hicache.model.batch import ForwardBatch
from hicache.model.kernels import key_blocks, ops
from hicache.parallel.parallel import ParallelContext
from hicache.parallel.placement import KVSharding


@dataclass
class ReadRows:
    """Where one read of the key-block plan takes its packed rows [size, row]: positions of a cached
    prefix from the gathered buffer, the step's own from its KV rows, and zeros past a sequence's end
    (masked)."""

    size: int
    prefix_dst: torch.Tensor
    prefix_src: torch.Tensor  # rows of the gathered buffer
    step_dst: torch.Tensor
    step_src: torch.Tensor  # rows of the step's KV


@dataclass
class GatheredMetadata:
    num_rows: int  # T: the batch's rows
    rows: torch.Tensor | None  # this rank's batch rows, padded to per_rank (None: it computes all rows)
    per_rank: int
    owned: OwnedSlots  # the step's slots this rank stores
    plan: key_blocks.KeyBlockPlan
    reads: list[ReadRows] = field(default_factory=list)
    gather: PrefixGather | None = None


class GatheredAttention:
    def __init__(self, scale: float, device: torch.device, pctx: ParallelContext, sharding: KVSharding) -> None:
        self.scale = scale
        self.device = device
        self.sharding = sharding
        self.group = pctx.group(sharding.axis) if sharding.axis else None
        self.side_group = pctx.side_group(sharding.axis) if sharding.axis else None
        self.stats = GatherStats()
        self.scratch: ScratchBuffers | None = None

    @property
    def scratch_bytes(self) -> int:
        return self.scratch.nbytes if self.scratch is not None else 0

    # ---- once per forward pass ---------------------------------------------------------------------

    def _stride(self) -> tuple[int, int]:
        """(N, r): this rank's rows are r, r + N, r + 2N, ... of the batch; (1, 0) without a split."""
        s = self.sharding
        return (s.size, s.rank) if s.split_tokens else (1, 0)

    def prepare(self, batch: ForwardBatch, pool: DeviceKVPool) -> GatheredMetadata:
        n, r = self._stride()
        T = batch.num_tokens
        per_rank = -(-T // n)
        rows = None
        if self.sharding.split_tokens:
            mine = list(range(r, T, n))
            # Equal row counts on every rank (the all-gathers need them): one spare copy of a row,
            # whose results are dropped, where a rank has one row fewer.
            mine += [mine[-1] if mine else 0] * (per_rank - len(mine))
            rows = torch.tensor(mine, dtype=torch.int64, device=self.device)
        meta = GatheredMetadata(T, rows, per_rank, pool.owned(batch.out_slots),
                                key_blocks.plan(step_queries(batch, n, r), per_rank, self.device))  # fmt: skip
        p = pool.page_size
        prefixes = [seq.kv_slots[: seq.kv_len - seq.length : p] // p for seq in batch.seqs]
        plan = GatherPlan.build([q.cpu() for q in prefixes if len(q)], self.sharding.size, self.sharding.rank,
                                self.device)  # fmt: skip
        prefix_rows = [plan.rows(seq.kv_slots[: seq.kv_len - seq.length], p) for seq in batch.seqs]
        meta.reads = [self._read_rows(batch, prefix_rows, read) for read in meta.plan.reads]
        if plan.per_owner:
            self._ensure_scratch(pool)
            assert self.scratch is not None
            meta.gather = PrefixGather(plan, pool, self.scratch, self.side_group, batch.before_layer, self.stats)
        return meta

    def _read_rows(self, batch: ForwardBatch, prefix_rows: list[torch.Tensor], read: key_blocks.BlockRead) -> ReadRows:
        """A read's positions in the gathered prefix (`prefix_rows`: each sequence's, in position order)
        and in the step's KV rows."""
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for e, (s, first) in enumerate(read.entries):
            seq, base = batch.seqs[s], e * read.length
            cached = seq.kv_len - seq.length
            stop = min(first + read.length, seq.kv_len)
            # Keys [first, split) are in the cached prefix, [split, stop) in this step. A block may lie
            # wholly on either side (past a block of context), so split is clamped into the block.
            split = min(max(first, cached), stop)
            old = torch.arange(first, split, device=self.device)
            new = torch.arange(split, stop, device=self.device)
            parts[0].append(base + old - first)
            parts[1].append(prefix_rows[s][old])
            parts[2].append(base + new - first)
            parts[3].append(seq.start + new - cached)
        return ReadRows(len(read.entries) * read.length, *(torch.cat(x) for x in parts))

    def _ensure_scratch(self, pool: DeviceKVPool) -> None:
        # What admission lets one layer's gather hold (hicache/cache/page_budget.py), or a whole
        # layer of the logical pool.
        per_class = pool.gather_pages if pool.gather_pages is not None else pool.local_pages
        rows = self.sharding.size * per_class * pool.page_size
        s = self.scratch
        if s is None or s.rows < rows or s.row_numel != pool.layout.row_numel or s.dtype != pool.dtype:
            self.scratch = ScratchBuffers(rows, pool.layout.row_numel, pool.dtype, pool.device)

    def local_rows(self, meta: GatheredMetadata) -> torch.Tensor | None:
        return meta.rows

    # ---- per layer ---------------------------------------------------------------------------------

    def _all_rows(self, mine: torch.Tensor, meta: GatheredMetadata) -> torch.Tensor:
        """Every rank's rows [per_rank, ...] -> the batch's rows [T, ...] in order (row i from rank i mod N)."""
        if meta.rows is None:
            return mine
        n = self.sharding.size
        out = mine.new_empty(n, *mine.shape)
        dist.all_gather(list(out.unbind(0)), mine.contiguous(), group=self.group)
        return out.transpose(0, 1).reshape(n * meta.per_rank, *mine.shape[1:])[: meta.num_rows]

    def forward(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta: GatheredMetadata, pool: DeviceKVPool, expand: Expand
    ) -> torch.Tensor:
        started = time.perf_counter()
        step_kv = self._all_rows(kv, meta)
        self.stats.step_kv_s += time.perf_counter() - started
        gathered = meta.gather.wait(layer) if meta.gather is not None else None
        attending = time.perf_counter()
        try:
            # After the gather of this layer: a prefix page this step also writes to was read first.
            pool.write_rows(layer, meta.owned, step_kv)

            def read(i: int) -> tuple[torch.Tensor, torch.Tensor]:
                # Whole pool rows, as `expand` unpacks them: state a model keeps beside its KV (an MTP
                # head's hidden state) follows attention's columns, which lead the row.
                where = meta.reads[i]
                rows = step_kv.new_zeros(where.size, pool.layout.row_numel)
                if where.prefix_src.numel():
                    assert gathered is not None
                    rows[where.prefix_dst] = gathered.index_select(0, where.prefix_src)
                rows[where.step_dst, : step_kv.shape[1]] = step_kv.index_select(0, where.step_src)
                return expand(rows)

            return ops.block_attention(q, meta.plan, read, self.scale)
        finally:
            if meta.gather is not None:
                meta.gather.release(layer)
            self.stats.attend_s += time.perf_counter() - attending
            self.stats.attended_layers += 1

    def replayed_layers(self, meta: GatheredMetadata, pool: DeviceKVPool, expand: Expand, width: int,
                        layers: int) -> None:  # fmt: skip
        return None  # each layer gathers its own pages: nothing to replay in one call

    def collect(self, hidden: torch.Tensor, meta: GatheredMetadata) -> torch.Tensor:
        return self._all_rows(hidden, meta)

    def close(self, meta: Any) -> None:
        if isinstance(meta, GatheredMetadata) and meta.gather is not None:
            meta.gather.close()
