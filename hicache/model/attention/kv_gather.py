"""Reading sharded KV (docs/DESIGN.md, "CP page sharding"; the CP-gathered attention backend): before a
layer reads its cached prefix, the shard ranks all-gather their owned pages of it into one of two
alternating scratch buffers, and a page table maps that owner-ordered buffer to logical order.

`GatherPlan` is the page table of one forward pass: the distinct logical pages the step's sequences
read as their prefix (the KV that existed before this step), grouped by owner. Every rank contributes
the same number of pages, M, the most any owner holds: a rank that owns fewer sends its padding page
(local page 0) in the remaining places. The gathered buffer is [owner, M pages] and logical page q of
owner o at place k of o's list sits at buffer page o * M + k.

`PrefixGather` runs the plan's per-layer all-gathers on a thread of its own, on a process group of its
own, in layer order, each step ordered by events, never by timing:

    restore-completion event of layer l (a host -> device load of this rank's pages, if any)
        -> gather layer l into buffer l % 2 (after layer l - 2's attention released it)
        -> gathered event of layer l -> attention of layer l -> release of buffer l % 2

so layer l + 1's gather runs while layer l's attention and MLP compute, and the assembled KV never
exceeds two layers' buffers. The buffers hold what admission lets a gather hold, --cp-gather-tokens
per owner class (hicache/cache/page_budget.py), by default a whole layer of the logical pool; their
bytes are reported with the pool's (`scratch_bytes`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from hicache.mem.device_pool import DeviceKVPool
from hicache.parallel.threads import serial_kernels


@dataclass
class GatherStats:
    """What gathering cost, summed over forward passes (benchmarks/cp_bench.py reads it)."""

    layers: int = 0  # layer gathers run
    pages: int = 0  # pages gathered, padding included, over every layer
    gather_s: float = 0.0  # time in the all-gathers (the gather thread)
    wait_s: float = 0.0  # time attention waited for a gather (what overlap did not hide)
    restore_wait_s: float = 0.0  # time the gather thread waited for restores of its layer
    most_per_owner: int = 0  # the largest M (pages one rank contributed to one layer's gather)
    step_kv_s: float = 0.0  # time all-gathering the step's own new KV rows (forward thread)
    attend_s: float = 0.0  # time writing and attending, once the layer's KV was there (forward thread)
    attended_layers: int = 0


@dataclass(frozen=True)
class GatherPlan:
    """One forward pass's page table (see the module docstring)."""

    shards: int
    per_owner: int  # M: pages each rank contributes
    send: torch.Tensor  # [M] this rank's local pages to contribute, in place order
    table: torch.Tensor  # logical page -> buffer page (-1: not gathered)

    @classmethod
    def build(cls, prefix_pages: list[torch.Tensor], shards: int, rank: int, device: torch.device) -> GatherPlan:
        pages = torch.unique(torch.cat(prefix_pages)) if prefix_pages else torch.empty(0, dtype=torch.int64)
        owners = pages % shards
        by_owner = [pages[owners == o] for o in range(shards)]
        m = max((len(p) for p in by_owner), default=0)
        table = torch.full((int(pages.max()) + 1 if len(pages) else 0,), -1, dtype=torch.int64)
        for o, mine in enumerate(by_owner):
            table[mine] = o * m + torch.arange(len(mine))
        send = torch.zeros(m, dtype=torch.int64)  # local page 0: the padding page
        send[: len(by_owner[rank])] = by_owner[rank] // shards
        return cls(shards, m, send.to(device), table.to(device))

    def rows(self, slots: torch.Tensor, page_size: int) -> torch.Tensor:
        """Rows of the flattened gathered buffer [N * M * page_size, row] holding these logical slots."""
        return self.table[slots // page_size] * page_size + slots % page_size


@dataclass(eq=False)
class ScratchBuffers:
    """The two alternating layer buffers, allocated once for the largest gather a pool allows."""

    rows: int
    row_numel: int
    dtype: torch.dtype
    device: torch.device
    buffers: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buffers = [torch.zeros(self.rows, self.row_numel, dtype=self.dtype, device=self.device) for _ in range(2)]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class PrefixGather:
    """The gather thread of one forward pass (see the module docstring)."""

    def __init__(
        self,
        plan: GatherPlan,
        pool: DeviceKVPool,
        scratch: ScratchBuffers,
        group: Any,
        restored: Callable[[int], None] | None,
        stats: GatherStats,
    ) -> None:
        self.plan = plan
        self.pool = pool
        self.rows = plan.shards * plan.per_owner * pool.page_size
        self.buffers = [b[: self.rows] for b in scratch.buffers]
        self.group = group
        self.restored = restored
        self.stats = stats
        num_layers = pool.num_layers
        self.gathered = [threading.Event() for _ in range(num_layers)]
        self.released = [threading.Event() for _ in range(num_layers)]
        self.error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hicache-kv-gather", daemon=True)
        self._thread.start()

    @torch.inference_mode()  # the forward pass's tensors (pool, scratch) are inference tensors
    def _run(self) -> None:
        serial_kernels()
        try:
            for layer in range(self.pool.num_layers):
                started = time.perf_counter()
                if self.restored is not None:
                    self.restored(layer)  # this rank's restored pages of the layer have landed
                if layer >= 2:
                    self.released[layer - 2].wait()  # attention of layer - 2 is done with the buffer
                if self._stop:
                    return
                gathering = time.perf_counter()
                self.stats.restore_wait_s += gathering - started
                self._gather(layer)
                self.stats.gather_s += time.perf_counter() - gathering
                self.stats.layers += 1
                self.stats.pages += self.plan.shards * self.plan.per_owner
                self.stats.most_per_owner = max(self.stats.most_per_owner, self.plan.per_owner)
                self.gathered[layer].set()
        except BaseException as exc:  # noqa: BLE001 - handed to the forward pass, which raises it
            self.error = exc
            for event in self.gathered:
                event.set()

    def _gather(self, layer: int) -> None:
        out = self.buffers[layer % 2].view(self.plan.shards, -1)
        send = self.pool.pages_of_layer(layer).index_select(0, self.plan.send).view(-1)
        if self.plan.shards == 1 or self.group is None:
            out[0].copy_(send)
            return
        dist.all_gather(list(out.unbind(0)), send, group=self.group)

    def wait(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s gathered prefix pages [N * M * page_size, row], once they are there."""
        started = time.perf_counter()
        self.gathered[layer].wait()
        self.stats.wait_s += time.perf_counter() - started
        if self.error is not None:
            raise RuntimeError(f"KV page gather failed: {self.error}") from self.error
        return self.buffers[layer % 2]

    def release(self, layer: int) -> None:
        """Attention of `layer` is done with its buffer (the gather of layer + 2 may overwrite it)."""
        self.released[layer].set()

    def close(self) -> None:
        """Stop after the layer in flight (a failed forward pass must not leave the thread waiting)."""
        self._stop = True
        for event in self.released:
            event.set()


def rows_from_owners(pool: DeviceKVPool, layer: int, slots: torch.Tensor, group: Any) -> torch.Tensor:
    """Packed rows [len(slots), row] of layer `layer` at `slots` of a page-sharded pool, whichever rank
    holds each: every rank reads the rows it owns (zeros in place of the others'), the group all-gathers
    them, and each row is taken from its owner's part, a copy, never a sum, so its bits are the owner's.
    For a model whose row reads another token's (an MTP head's predecessor, which may sit on a page of
    another rank); every rank of `group` calls it with the same slots."""
    where = pool.owned(slots)
    if where.index is None:
        return pool.read_rows(layer, slots)
    mine = torch.zeros(len(slots), pool.layout.row_numel, dtype=pool.dtype, device=pool.device)
    mine[where.index.to(pool.device)] = pool.buffers[layer].index_select(0, where.rows)
    parts = [torch.empty_like(mine) for _ in range(pool.placement.shards)]
    dist.all_gather(parts, mine, group=group)
    owners = pool.placement.owners(slots).to(pool.device)
    return torch.stack(parts)[owners, torch.arange(len(slots), device=pool.device)]
