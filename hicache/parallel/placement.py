"""Page placement (docs/DESIGN.md, "page placement"): where a logical KV page lives when a layer's pages are
sharded over N ranks, by arithmetic alone, and which ranks shard, write and read them.

Logical slot x, page size p, N shard ranks:

    q = x // p            the logical page
    r = q mod N           its owner
    l = (q // N) * p + x mod p    the owner's local row

No table: every rank computes any page's owner and address. With N > 1 the logical pages 0..N-1 are
reserved: page r is rank r's local page 0, its padding page, which it contributes to an all-gather in
which it owns fewer of the gathered pages than another rank (so allocatable pages of owner class r are
r + N, r + 2N, ...). With that convention the worked example of docs/DESIGN.md, "CP page sharding"
(figure 1a of SGLang's HiCache report) comes out exactly: on two ranks A, B, C of a new prefix get
logical pages 2, 3, 4 (rank 0 local page 1, rank 1 local page 1, rank 0 local page 2), and extending
A/B/C with D gives D logical page 5, rank 1's local page 2. At N = 1 nothing is reserved and a slot is
its own row.

Which ranks shard (`kv_sharding`): the context-parallel group when --cp-size > 1; otherwise, for a
model whose KV is replicated over the attention-TP ranks (MLA's one latent vector per token), the TP
group; otherwise nobody (GQA without CP keeps its heads' pages whole on every TP rank).

Which ranks write a page to storage (`storage_shard`): one per distinct copy of the bytes. Keys carry
the shard rank, so each shard rank writes its own pages; where TP ranks hold identical bytes (MLA's
latent, sharded over CP), the writer is elected per shard rank (TP rank 0 of each CP rank), never once
over the whole attention group: SGLang's bug #37149 elected on the wrong axis, so only CP rank 0
wrote and a fresh reader's agreed hit (the MIN over the shard group) was 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.parallel.parallel import ParallelContext


@dataclass(frozen=True)
class Placement:
    """The arithmetic of one pool's pages over `shards` ranks (pages of `page_size` slots)."""

    shards: int = 1
    page_size: int = 1

    def __post_init__(self) -> None:
        if self.shards < 1 or self.page_size < 1:
            raise ValueError(f"placement needs shards >= 1 and page_size >= 1, got {self.shards}, {self.page_size}")

    @property
    def reserved(self) -> int:
        """Leading logical pages that are padding pages (one per rank), never allocated."""
        return self.shards if self.shards > 1 else 0

    def owner(self, page: int) -> int:
        return page % self.shards

    def local_page(self, page: int) -> int:
        return page // self.shards

    def logical_page(self, owner: int, local_page: int) -> int:
        """The inverse of (owner, local_page)."""
        return local_page * self.shards + owner

    def local_row(self, slot: int) -> int:
        q, offset = divmod(slot, self.page_size)
        return (q // self.shards) * self.page_size + offset

    def slot_of(self, owner: int, row: int) -> int:
        """The inverse of (owner(slot // p), local_row(slot))."""
        local, offset = divmod(row, self.page_size)
        return self.logical_page(owner, local) * self.page_size + offset

    def class_pages(self, owner: int, local_pages: int) -> list[int]:
        """The allocatable logical pages of owner class `owner` when each rank has `local_pages`."""
        first = 1 if self.shards > 1 else 0
        return [self.logical_page(owner, j) for j in range(first, local_pages)]

    def rotation_classes(self, base: int, first: int, count: int) -> list[int]:
        """Owner classes of pages first..first+count-1 of a prefix whose page 0 is on class `base`:
        owners cycle along every prefix, page P on class (base + P) mod N."""
        return [(base + i) % self.shards for i in range(first, first + count)]

    # ---- tensors (the copy boundary) -------------------------------------------------------------

    def owners(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots // self.page_size) % self.shards

    def local_rows(self, slots: torch.Tensor) -> torch.Tensor:
        p = self.page_size
        return (slots // p // self.shards) * p + slots % p


@dataclass(frozen=True)
class KVSharding:
    """The group a layer's pages are sharded over, and this rank's place in it."""

    axis: str | None = None  # "cp", "tp" or None (pages kept whole)
    size: int = 1
    rank: int = 0
    split_tokens: bool = False  # CP: the step's new tokens are computed by the group's ranks in turn

    def placement(self, page_size: int) -> Placement:
        return Placement(self.size, page_size)


def kv_sharding(pctx: ParallelContext, replicated_over_tp: bool) -> KVSharding:
    """Which ranks share a layer's pages (see the module docstring). `replicated_over_tp`: every
    attention-TP rank would otherwise hold the same KV bytes (MLA)."""
    if pctx.cp_size > 1:
        return KVSharding("cp", pctx.cp_size, pctx.cp_rank, split_tokens=True)
    if replicated_over_tp and pctx.tp_size > 1:
        return KVSharding("tp", pctx.tp_size, pctx.tp_rank)
    return KVSharding()


@dataclass(frozen=True)
class StorageShard:
    suffix: str  # names the bytes this rank stores, in every storage key
    writes: bool  # this rank is the elected writer of those bytes


def storage_shard(pctx: ParallelContext, sharding: KVSharding, replicated_over_tp: bool) -> StorageShard:
    """This rank's storage identity. TP ranks with distinct heads each write theirs; TP ranks holding
    one replicated copy (MLA sharded over CP) share a key without the TP index and elect TP rank 0 of
    their CP rank, i.e. one writer per shard rank."""
    pp = f"_pp{pctx.pp_rank}of{pctx.pp_size}"
    cp = f"_cp{pctx.cp_rank}of{pctx.cp_size}" if pctx.cp_size > 1 else ""
    if replicated_over_tp and sharding.axis != "tp":
        return StorageShard(f"latent{pp}{cp}", writes=pctx.tp_rank == 0)
    return StorageShard(f"tp{pctx.tp_rank}of{pctx.tp_size}{pp}{cp}", writes=True)
