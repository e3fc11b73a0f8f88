"""The unified KV storage layout (docs/DESIGN.md, "Unified layout"): one stored representation shared by
every compatible topology, so a TP4xPP2 writer and a TP2xPP1 reader use the same objects.

Pure arithmetic, no I/O. A page is cut on a fixed `Grid` of layer ranges (`layer_partition` layers
each, the last one ragged) x head groups (`head_partition` KV heads each; none for MLA, whose latent
is the same for every head). Each cell is one object, named by what it holds, never by who wrote it:

    {page_hash}_{namespace_digest}_L{start_layer}-{end_layer}[_H{head_group}]

with model-global, inclusive layer numbers and model-global head groups. Object bytes (`CellLayout`):
MHA (layer, K/V, token_in_page, head_in_group, head_dim); MLA (layer, token_in_page, dim). The layer is
outermost, so any run of a cell's layers is one contiguous span (a ranged read: offset + length).

A rank holds a `Shard` (its global layers and KV heads). It writes the cells inside its shard and
reads the spans of the cells its shard overlaps. Writers must own whole cells, so a topology whose TP
or PP boundaries cut a head group or a layer range is refused (`check_aligned`, naming the boundary).
The `UnifiedNamespace` digest covers everything that makes the bytes mean something and nothing about
the topology, so readers of any compatible topology compute the same keys; another model, dtype, page
size or grid is another digest, i.e. a miss, never wrong bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from hicache.errors import UserError
from hicache.parallel.parallel import split_range
from hicache.storage.keys import HASH_BYTES, NAMESPACE_DIGEST_HEX

SCHEMA_VERSION = 1
KEY_SCHEMES = ("rank-suffix", "unified")
MHA_ORDER = "layer,kv,token,head_in_group,head_dim"  # within one object; head groups are objects
MLA_ORDER = "layer,token,dim"


@dataclass(frozen=True)
class KVGeometry:
    """What one token's KV is, model-wide. MHA: K and V of (num_kv_heads, head_dim) per layer. MLA
    (`latent`): one row of `head_dim` elements per layer (latent + rope), replicated across TP."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    latent: bool = False

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"invalid KV geometry {self}")


@dataclass(frozen=True)
class Cell:
    """One object of a page: layers `layers` (model-global) of head group `group` (None: MLA)."""

    layers: range
    group: int | None

    @property
    def suffix(self) -> str:
        head = "" if self.group is None else f"_H{self.group}"
        return f"L{self.layers.start}-{self.layers.stop - 1}{head}"


@dataclass(frozen=True)
class Shard:
    """The model-global KV a rank holds: layers [layers) and KV heads [heads) (MLA: every head)."""

    layers: range
    heads: range


@dataclass(frozen=True)
class Span:
    """What a rank needs of one object: layers `layers` of `cell`, bytes [offset, offset+length) of the
    object's data, landing at bytes [local_offset, local_offset+length) of the rank's host page."""

    cell: Cell
    layers: range
    offset: int
    length: int
    local_offset: int


@dataclass(frozen=True)
class Grid:
    """The partition of a page into cells: `layer_partition` layers per range, `head_partition` KV
    heads per group (ignored for MLA)."""

    geometry: KVGeometry
    layer_partition: int
    head_partition: int = 0

    def __post_init__(self) -> None:
        g = self.geometry
        if not 0 < self.layer_partition <= g.num_layers:
            raise UserError(
                f"--hicache-storage-layer-partition must be in 1..{g.num_layers}, got {self.layer_partition}"
            )
        if not g.latent and (self.head_partition <= 0 or g.num_kv_heads % self.head_partition):
            raise UserError(
                f"--hicache-storage-head-partition {self.head_partition} must divide the model's "
                f"{g.num_kv_heads} KV heads"
            )

    @cached_property
    def layer_ranges(self) -> tuple[range, ...]:
        n, step = self.geometry.num_layers, self.layer_partition
        return tuple(range(a, min(a + step, n)) for a in range(0, n, step))

    @property
    def groups(self) -> tuple[int | None, ...]:
        if self.geometry.latent:
            return (None,)
        return tuple(range(self.geometry.num_kv_heads // self.head_partition))

    @cached_property
    def cells(self) -> tuple[Cell, ...]:
        """Every object of a page, head group major (the page_unified host order)."""
        return tuple(Cell(r, g) for g in self.groups for r in self.layer_ranges)

    def group_heads(self, group: int | None) -> range:
        if group is None:
            return range(self.geometry.num_kv_heads)
        return range(group * self.head_partition, (group + 1) * self.head_partition)

    def layer_bytes(self, page_size: int, itemsize: int) -> int:
        """Bytes of one layer of one cell (one page): K and V of the group's heads, or one latent row."""
        g = self.geometry
        per_token = g.head_dim if g.latent else 2 * self.head_partition * g.head_dim
        return per_token * page_size * itemsize

    def describe(self) -> dict:
        """The grid as plain data (for the namespace digest and GET /hicache/storage_layout)."""
        g = self.geometry
        return {
            "num_layers": g.num_layers,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "layer_partition": self.layer_partition,
            "head_partition": 0 if g.latent else self.head_partition,
            "layer_ranges": [[r.start, r.stop - 1] for r in self.layer_ranges],
            "head_groups": 0 if g.latent else len(self.groups),
        }


@dataclass(frozen=True)
class UnifiedNamespace:
    """What every deployment sharing the objects must agree on; the digest is in every key and header.
    Nothing here names a rank, TP, PP or CP size."""

    model: str
    kv_dtype: str
    page_size: int
    grid: Grid
    schema_version: int = SCHEMA_VERSION
    part: str = ""  # another part of a page (a speculative draft's state, "draft"); "": the target's

    def __post_init__(self) -> None:
        if self.page_size <= 0 or not self.model or not self.kv_dtype:
            raise ValueError("model and kv_dtype must be non-empty and page_size positive")

    @property
    def replication(self) -> str:
        return "latent-replicated-tp" if self.grid.geometry.latent else "heads-sharded"

    @property
    def layout(self) -> str:
        return f"unified:{MLA_ORDER if self.grid.geometry.latent else MHA_ORDER}"

    def describe(self) -> dict:
        out = {
            "schema_version": self.schema_version,
            "model": self.model,
            "kv_dtype": self.kv_dtype,
            "page_size": self.page_size,
            "replication": self.replication,
            "layout": self.layout,
            "grid": self.grid.describe(),
        }
        # Only a part's namespace names it, so the target's digest is that of a cache without a draft.
        return {**out, "part": self.part} if self.part else out

    @cached_property
    def digest(self) -> str:
        canonical = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:NAMESPACE_DIGEST_HEX]

    def object_key(self, page_hash: bytes, cell: Cell) -> str:
        if len(page_hash) != HASH_BYTES:
            raise ValueError(f"page hash must be {HASH_BYTES} bytes, got {len(page_hash)}")
        return f"{page_hash.hex()}_{self.digest}_{cell.suffix}"


# ---- which rank does what ---------------------------------------------------------------------------


def shard_of(geometry: KVGeometry, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int) -> Shard:
    """A rank's shard as hicache/parallel/parallel.py splits the model: layers as evenly as possible over
    PP (earlier stages take the remainder), KV heads in equal contiguous blocks over TP (MLA: all)."""
    a, b = split_range(geometry.num_layers, pp_size, pp_rank)
    if geometry.latent:
        return Shard(range(a, b), range(geometry.num_kv_heads))
    if geometry.num_kv_heads % tp_size:
        raise UserError(f"--tp-size {tp_size} does not divide the model's {geometry.num_kv_heads} KV heads")
    per = geometry.num_kv_heads // tp_size
    return Shard(range(a, b), range(tp_rank * per, (tp_rank + 1) * per))


def check_aligned(grid: Grid, shard: Shard, who: str = "this rank") -> None:
    """UserError unless `shard`'s boundaries are grid boundaries (a writer must own whole cells),
    naming the boundary that is off and the flag that sets it."""
    starts = {r.start for r in grid.layer_ranges} | {grid.geometry.num_layers}
    for end, edge in ((shard.layers.start, "starts"), (shard.layers.stop, "ends")):
        if end not in starts:
            cut = next(r for r in grid.layer_ranges if r.start < end < r.stop)
            raise UserError(
                f"{who}'s pipeline stage {edge} at layer {end}, inside the storage layer range "
                f"L{cut.start}-{cut.stop - 1} (--hicache-storage-layer-partition {grid.layer_partition}): "
                "choose a layer partition whose ranges the --pp-size split does not cut"
            )
    if grid.geometry.latent:
        return
    h = grid.head_partition
    for end, edge in ((shard.heads.start, "start"), (shard.heads.stop, "end")):
        if end % h:
            raise UserError(
                f"{who}'s KV heads {edge} at head {end}, inside head group H{end // h} = heads "
                f"{end // h * h}-{end // h * h + h - 1} (--hicache-storage-head-partition {h}): "
                "choose a head partition that divides the KV heads per --tp-size rank"
            )


def cells_of(grid: Grid, shard: Shard) -> list[Cell]:
    """The cells `shard` overlaps, in page_unified order (head group major, then layers)."""
    return [
        c for c in grid.cells
        if _overlap(c.layers, shard.layers) and _overlap(grid.group_heads(c.group), shard.heads)
    ]  # fmt: skip


def writes(grid: Grid, shard: Shard) -> list[Cell]:
    """The objects a rank writes: the cells entirely inside its shard."""
    return [
        c for c in cells_of(grid, shard)
        if _inside(c.layers, shard.layers) and _inside(grid.group_heads(c.group), shard.heads)
    ]  # fmt: skip


def local_page_bytes(grid: Grid, shard: Shard, page_size: int, itemsize: int) -> int:
    """Size of a rank's page_unified host page: its layers of its head groups."""
    groups = len({c.group for c in cells_of(grid, shard)})
    return groups * len(shard.layers) * grid.layer_bytes(page_size, itemsize)


def reads(grid: Grid, shard: Shard, page_size: int, itemsize: int) -> list[Span]:
    """The byte spans a rank needs of each object it overlaps, and where each lands in its host page
    (page_unified: head group major, then its layers). Head groups must be whole (heads are the
    innermost-but-one dimension, so part of a group is not one span); layers may be any sub-run."""
    lb = grid.layer_bytes(page_size, itemsize)
    cells = cells_of(grid, shard)
    groups = sorted({c.group for c in cells}, key=lambda g: -1 if g is None else g)
    out = []
    for cell in cells:
        heads = grid.group_heads(cell.group)
        if not _inside(heads, shard.heads):
            raise UserError(f"KV heads {shard.heads.start}-{shard.heads.stop - 1} cut head group H{cell.group}")
        a, b = max(cell.layers.start, shard.layers.start), min(cell.layers.stop, shard.layers.stop)
        base = groups.index(cell.group) * len(shard.layers) * lb
        out.append(Span(cell, range(a, b), (a - cell.layers.start) * lb, (b - a) * lb,
                        base + (a - shard.layers.start) * lb))  # fmt: skip
    return out


def _overlap(a: range, b: range) -> bool:
    return max(a.start, b.start) < min(a.stop, b.stop)


def _inside(a: range, b: range) -> bool:
    return b.start <= a.start and a.stop <= b.stop
