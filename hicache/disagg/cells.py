"""P/D disaggregation: which cells of a prompt's KV each prefill rank sends each decode rank, so that a
prefill server and a decode server of different topologies pair (docs/DESIGN.md, "P/D across topologies").

Every rank holds a `Shard` of each page, as the unified layout places it (hicache/storage/unified.py):
its pipeline stage's layers x its TP shard's KV heads, model-global. The unit of transfer is a cell
of that layout, a layer range x a KV-head range: what prefill rank p sends decode rank d is the cell
where their shards meet (`peers`), so each decode rank receives its shard exactly once, from every
prefill rank it overlaps, whatever the two TP and PP sizes. Both sides compute the same plan from the
two handshakes, so no plan travels. Within a row, a cell is one element range per KV component
(`Cut`): K of the shared heads, then V of them.

A pair is misaligned when a cell's head boundary would cut a KV component that is not split by heads
(a latent row, a per-token state): `misaligned` refuses it at start-up naming the boundary, as the
unified store refuses a topology whose boundaries cut one of its cells.

With speculative decoding a transfer also moves the draft's rows (docs/DESIGN.md, "Speculation x P/D"):
every pipeline stage holds all of the draft's layers (its TP rank's share of them), so each decode rank
takes them whole, once, from the prefill ranks of its own TP rank on one stage (`draft_sources`), after
their target cells (`cuts`): one rank, or under CP each of the stage's CP ranks for the pages it owns
(the draft's pages are sharded like the target's), checked like the target's cells. A pair of two TP sizes
with a draft is refused, and so is a draft beside KV pages sharded over TP (MLA).

Page ownership is the third cut (docs/DESIGN.md, "P/D across topologies"). Under context parallelism
(and for MLA at TP > 1) a rank holds the cells of its (PP, TP) shard for only the pages it owns (page q
on owner class q mod N, hicache/parallel/placement.py), so every CP rank of prefill is a peer of the
decode ranks its cells overlap, and sends each of them the rows of the pages it owns, naming those pages
(prompt page indices) in each message; a decode rank whose own pages are sharded keeps the rows of the
pages it owns and drops the rest. Which pages a rank owns depends on the request's page ids, which each
server allocates for itself, so that part cannot come from the handshakes: it travels as the page list,
and decode checks that the page-sharded sources of one cell cover every page of the transfer exactly once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hicache.disagg.handshake import Handshake
from hicache.parallel.parallel import Mesh
from hicache.storage.unified import KVGeometry, Shard, shard_of


@dataclass(frozen=True)
class Cut:
    """Where cells lie in one rank's pool: the local layers they cover, and the element ranges
    [start, stop) of a row that hold their heads (the rows travel as those ranges, concatenated)."""

    layers: range
    columns: tuple[tuple[int, int], ...]
    row_numel: int

    @property
    def width(self) -> int:
        return sum(stop - start for start, stop in self.columns)

    @property
    def whole_rows(self) -> bool:
        return self.columns == ((0, self.row_numel),)


def shard(hs: Handshake) -> Shard:
    geometry = KVGeometry(hs.num_layers, hs.num_kv_heads, hs.kv_layout[0][1][-1], hs.latent)
    return shard_of(geometry, hs.tp_size, hs.tp_rank, hs.pp_size, hs.pp_rank)


def _mesh(hs: Handshake) -> Mesh:
    return Mesh(pp=hs.pp_size, cp=hs.cp_size, tp=hs.tp_size)


def rank(hs: Handshake) -> int:
    """The rank index of `hs`'s rank in its server (where its transfer endpoint listens: base port + it)."""
    return _mesh(hs).rank_of(pp=hs.pp_rank, cp=hs.cp_rank, tp=hs.tp_rank)


def everyone(hs: Handshake) -> list[Handshake]:
    """The handshake of every rank of `hs`'s server, by rank index (the row layout is the same on all)."""
    out = []
    for r in range(_mesh(hs).world_size):
        coords = _mesh(hs).coords_of(r)
        placed = dataclasses.replace(hs, tp_rank=coords["tp"], pp_rank=coords["pp"], cp_rank=coords["cp"])
        layers = shard(placed).layers
        out.append(dataclasses.replace(placed, layers=(layers.start, layers.stop)))
    return out


def peers(mine: Handshake, theirs: Handshake) -> dict[int, Shard]:
    """The ranks of `theirs`'s server (any rank's handshake names it) that share KV with `mine`'s rank,
    by rank index, and the cells each pair exchanges: the overlap of their two shards, model-global.
    Ranks whose pages are sharded (CP, MLA's TP) hold the same cells on different pages: each of them is
    a peer, and a transfer from one of them moves only the pages it owns (kv_rows.PoolRows.held)."""
    a = shard(mine)
    out = {}
    for other in everyone(theirs):
        b = shard(other)
        layers = range(max(a.layers.start, b.layers.start), min(a.layers.stop, b.layers.stop))
        heads = range(max(a.heads.start, b.heads.start), min(a.heads.stop, b.heads.stop))
        if len(layers) and len(heads):
            out[rank(other)] = Shard(layers, heads)
    return out


def cut(hs: Handshake, cells: Shard) -> Cut:
    """Where `cells` lie in the rows of `hs`'s rank (ValueError if they cut a component not split by heads)."""
    mine = shard(hs)
    columns, offset = [], 0
    for name, shape in hs.kv_layout:
        numel = math.prod(shape)
        if cells.heads == mine.heads:
            columns.append((offset, offset + numel))
        elif _per_head(hs, shape):
            per = numel // shape[0]
            first = cells.heads.start - mine.heads.start
            columns.append((offset + first * per, offset + (first + len(cells.heads)) * per))
        else:
            raise ValueError(f"KV component {name!r} {shape} is not split by KV heads")
        offset += numel
    local = range(cells.layers.start - mine.layers.start, cells.layers.stop - mine.layers.start)
    return Cut(local, tuple(_merged(columns)), offset)


def draft_sources(prefill: Handshake, decode: Handshake) -> list[int]:
    """The rank indices of `prefill`'s server that send `decode`'s rank the draft's rows: of decode's TP rank,
    on decode's own stage when both have one PP size (a pair that moves the target's KV too), else on the
    last stage (any stage computes the same rows; the last is the one with the target's last hidden states);
    every CP rank there, each for the pages it owns, as for the target's cells (one rank without CP)."""
    stage = decode.pp_rank if prefill.pp_size == decode.pp_size else prefill.pp_size - 1
    mesh = _mesh(prefill)
    return [mesh.rank_of(pp=stage, cp=cp, tp=decode.tp_rank) for cp in range(prefill.cp_size)]


def sends_draft(prefill: Handshake, decode: Handshake) -> bool:
    """Whether `prefill`'s rank sends `decode`'s rank the draft's rows."""
    return bool(prefill.draft_layers) and rank(prefill) in draft_sources(prefill, decode)


def cuts(hs: Handshake, cells: Shard, draft: bool) -> tuple[Cut, ...]:
    """Where a transfer's parts lie in `hs`'s rank's rows, in the order its frames travel: the target's
    `cells`, then, where the pair moves the draft (`sends_draft`), every layer of the draft's pool whole
    (its layers numbered after the target's local ones, as `kv_rows.PoolRows` reads them)."""
    target = cut(hs, cells)
    if not draft:
        return (target,)
    row = sum(math.prod(shape) for _, shape in hs.draft_kv_layout)
    local = hs.layers[1] - hs.layers[0]
    return target, Cut(range(local, local + hs.draft_layers), ((0, row),), row)


def misaligned(prefill: Handshake, decode: Handshake, p_name: str = "prefill", d_name: str = "decode") -> str | None:
    """Why some cell of the pair cannot be cut out of one side's rows and laid into the other's (the
    boundary that cuts a KV row, or rows of other components, or a draft between two topologies); None
    when every rank pair aligns."""
    problem = _draft_misaligned(prefill, decode, p_name, d_name)
    if problem is not None:
        return problem
    p_row = [(name, _per_rank(prefill, shape)) for name, shape in prefill.kv_layout]
    d_row = [(name, _per_rank(decode, shape)) for name, shape in decode.kv_layout]
    if p_row != d_row:
        return f"the KV rows differ: {p_name} {_describe(prefill)}, {d_name} {_describe(decode)}"
    for d_rank in everyone(decode):
        for p_index, cells in peers(d_rank, prefill).items():
            for side, hs, name in ((everyone(prefill)[p_index], prefill, p_name), (d_rank, decode, d_name)):
                try:
                    cut(side, cells)
                except ValueError as exc:
                    where = f"tp{d_rank.tp_rank}/pp{d_rank.pp_rank}"
                    return (
                        f"{d_name} rank {where} needs KV heads {cells.heads.start}-{cells.heads.stop - 1} of "
                        f"{p_name} rank tp{side.tp_rank}/pp{side.pp_rank}, a head boundary inside {name}'s KV "
                        f"row ({exc}): pair servers of one TP size"
                    )
    return None


def _draft_misaligned(prefill: Handshake, decode: Handshake, p_name: str, d_name: str) -> str | None:
    """Why some decode rank cannot take the draft's rows whole from one prefill rank (None: each can)."""
    if not prefill.draft_layers:
        return None
    if any(hs.page_shards > hs.cp_size for hs in (prefill, decode)):  # pages sharded over TP too
        return SHARDED_DRAFT
    if prefill.tp_size != decode.tp_size:
        return (
            f"speculative decoding between two TP sizes is not supported yet ({p_name} TP{prefill.tp_size}, "
            f"{d_name} TP{decode.tp_size}): each decode rank takes the draft's rows whole from one prefill rank; "
            "pair servers of one TP size"
        )
    for d_rank in everyone(decode):
        if any(source not in peers(d_rank, prefill) for source in draft_sources(prefill, d_rank)):
            return (
                f"{d_name} rank tp{d_rank.tp_rank}/pp{d_rank.pp_rank} shares no layers with {p_name}'s last stage, "
                f"which would send it the draft's rows: pair a decode server of one pipeline stage or {prefill.pp_size}"
            )
    return None


SHARDED_DRAFT = (
    "speculative decoding with P/D and KV pages sharded over TP (an MLA model at --tp-size > 1) is not "
    "supported yet: the draft's pages are not sharded that way"
)


def _per_head(hs: Handshake, shape: tuple[int, ...]) -> bool:
    """Whether a component holds one slice per local KV head (so a head range of it is one span)."""
    return not hs.latent and len(shape) > 1 and shape[0] == len(shard(hs).heads)


def _per_rank(hs: Handshake, shape: tuple[int, ...]) -> tuple[object, ...]:
    """A component's shape with its per-head axis named rather than counted: equal on every TP size."""
    return ("heads", *shape[1:]) if _per_head(hs, shape) else shape


def _describe(hs: Handshake) -> str:
    return "+".join(f"{name}{shape}" for name, shape in hs.kv_layout)


def _merged(columns: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent element ranges as one (whole rows are one range: one copy instead of one per component)."""
    out: list[tuple[int, int]] = []
    for start, stop in columns:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out
