"""P/D disaggregation: the handshake, what a prefill rank and a decode rank must share before KV computed
on one may be extended on the other.

Every GEMM and attention call is batch-invariant (hicache/model/kernels/ops.py), so a prompt's KV computed by a
prefill server and then extended by a decode server gives the same tokens as one server — but only if
both run the same weights, dtype, page size and model geometry, and the same kernel mechanisms (those
both ranks run), each verified by its start-up self-check. `mismatch` names the first field that
differs. The two servers' topologies may differ: a handshake also says where the rank sits (TP, CP and
PP size and position, its KV row, how many ranks its pages are sharded over), and cells.py works out
which cells each prefill rank sends each decode rank, refusing a pair whose boundaries cut a KV row
(docs/DESIGN.md, "P/D across topologies"). With speculative decoding it also names the draft and what
of its state each transfer moves: the two servers must run the same one (docs/DESIGN.md, "Speculation x
P/D").
`hicache router` checks the servers' rank-0 handshakes at start-up, and every transfer carries the
decode rank's handshake, which each of its prefill peers checks against its own before it sends anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hicache.mem.device_pool import DeviceKVPool
from hicache.model.base import DecoderModel
from hicache.parallel.parallel import ParallelContext

# 2: the model geometry, so the two sides may differ in topology; 3: the draft, and WORKING messages;
# 4: context parallelism and page sharding (a rank holding every N-th page sends only those)
HANDSHAKE_VERSION = 4
NO_DRAFT = "none"

# Field -> how a mismatch is named, in the order they are compared (the most basic first).
_FIELDS = {
    "version": "handshake version",
    "model": "model (weights digest)",
    "dtype": "KV dtype",
    "page_size": "page size",
    "num_layers": "number of layers",
    "num_kv_heads": "number of KV heads",
    "latent": "KV replication (MLA's latent row or per-head K/V)",
    "draft": "speculative draft (--speculative-draft-model)",
    "draft_layers": "draft layers a transfer moves (--debug-skip-draft-restore moves none)",
}


@dataclass(frozen=True)
class Handshake:
    """One rank's identity as a KV producer or consumer (JSON-able, compared field by field)."""

    model: str
    dtype: str
    page_size: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    layers: tuple[int, int]  # [start, end) of the model's layers this rank holds
    num_layers: int  # the model's; with num_kv_heads and latent, what places every rank of any topology
    num_kv_heads: int
    latent: bool  # one row for every KV head (MLA), replicated over TP, instead of per-head K and V
    kv_layout: tuple[tuple[str, tuple[int, ...]], ...]  # (component, shape) of one token's row per layer
    verified: bool  # the start-up batch-invariance self-check passed
    mechanisms: tuple[tuple[str, str], ...]
    # A speculative draft: its name and weights digest, the layers of its pool each transfer moves after
    # the target's (all on every rank: hicache/spec/build.py), and one token's row of them.
    draft: str = NO_DRAFT
    draft_layers: int = 0
    draft_kv_layout: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Context parallelism: a rank's cells are the same on every CP rank (cells.py), its pages are not:
    # with its pool's pages sharded over `page_shards` ranks (CP, or TP for MLA) it holds every N-th one.
    cp_size: int = 1
    cp_rank: int = 0
    page_shards: int = 1
    version: int = HANDSHAKE_VERSION

    @classmethod
    def of(
        cls, identity: str, model: DecoderModel, pool: DeviceKVPool, pctx: ParallelContext,
        draft: SpeculativeDraft | None = None,
    ) -> Handshake:  # fmt: skip
        report = model.invariance
        moved = draft is not None and draft.moved
        return cls(
            model=identity,
            dtype=str(pool.dtype).removeprefix("torch."),
            page_size=pool.page_size,
            tp_size=pctx.tp_size,
            tp_rank=pctx.tp_rank,
            pp_size=pctx.pp_size,
            pp_rank=pctx.pp_rank,
            layers=tuple(model.layer_range),  # type: ignore[arg-type]
            cp_size=pctx.cp_size,
            cp_rank=pctx.cp_rank,
            page_shards=pool.placement.shards,
            num_layers=model.cfg.num_layers,
            num_kv_heads=model.cfg.num_kv_heads,
            latent=model.replicated_over_tp,
            kv_layout=_layout(pool),
            verified=bool(report is not None and report.verified),
            mechanisms=tuple(sorted((report.mechanisms if report is not None else {}).items())),
            draft=draft.describe() if draft is not None else NO_DRAFT,
            draft_layers=draft.pool.num_layers if draft is not None and moved else 0,
            draft_kv_layout=_layout(draft.pool) if draft is not None and moved else (),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Handshake:
        """Raises ValueError for a malformed handshake (a peer of another version or not hicache)."""
        try:
            return cls(
                model=str(data["model"]),
                dtype=str(data["dtype"]),
                page_size=int(data["page_size"]),
                tp_size=int(data["tp_size"]),
                tp_rank=int(data["tp_rank"]),
                pp_size=int(data["pp_size"]),
                pp_rank=int(data["pp_rank"]),
                layers=(int(data["layers"][0]), int(data["layers"][1])),
                # A peer of version 3 has no CP fields: its version is what `mismatch` names.
                cp_size=int(data.get("cp_size", 1)),
                cp_rank=int(data.get("cp_rank", 0)),
                page_shards=int(data.get("page_shards", 1)),
                num_layers=int(data["num_layers"]),
                num_kv_heads=int(data["num_kv_heads"]),
                latent=bool(data["latent"]),
                kv_layout=_parsed_layout(data["kv_layout"]),
                verified=bool(data["verified"]),
                mechanisms=tuple((str(k), str(v)) for k, v in data["mechanisms"]),
                # A peer of version 2 has no draft fields: its version is what `mismatch` names.
                draft=str(data.get("draft", NO_DRAFT)),
                draft_layers=int(data.get("draft_layers", 0)),
                draft_kv_layout=_parsed_layout(data.get("draft_kv_layout", ())),
                version=int(data["version"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"malformed handshake: {type(exc).__name__}: {exc}") from None

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's KV on this rank (every layer it holds, and the draft's it moves)."""
        elem = {"float32": 4, "bfloat16": 2, "float16": 2}.get(self.dtype, 4)
        numel = sum(_prod(shape) for _, shape in self.kv_layout)
        draft = sum(_prod(shape) for _, shape in self.draft_kv_layout)
        return (numel * (self.layers[1] - self.layers[0]) + draft * self.draft_layers) * elem

    def mismatch(self, other: Handshake, mine: str = "prefill", theirs: str = "decode") -> str | None:
        """Why KV of `self`'s cannot be extended by `other` (or the reverse), whatever their topologies
        (cells.py checks those); None when it can."""
        for name, what in _FIELDS.items():
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{what} differs: {mine} {_show(a)}, {theirs} {_show(b)}"
        # A kernel only one side runs (the LM head lives on the last stage) computes no KV the other extends.
        ours, others = dict(self.mechanisms), dict(other.mechanisms)
        for kernel in sorted(ours.keys() & others.keys()):
            if ours[kernel] != others[kernel]:
                what = f"batch-invariant kernel mechanism {kernel!r}"
                return f"{what} differs: {mine} {_show(ours[kernel])}, {theirs} {_show(others[kernel])}"
        for side, hs in ((mine, self), (theirs, other)):
            if not hs.verified:
                return f"the batch-invariance self-check did not pass on {side}, so its KV could change answers"
        return None


@dataclass(frozen=True)
class SpeculativeDraft:
    """What a handshake says of this rank's speculative draft: its name, its weights digest, its device
    pool, and whether transfers move its state (not under --debug-skip-draft-restore)."""

    name: str
    identity: str
    pool: DeviceKVPool
    moved: bool = True

    def describe(self) -> str:
        return f"{self.name} ({self.identity[:12]})"


def _layout(pool: DeviceKVPool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((c.name, tuple(c.shape)) for c in pool.layout.components)


def _parsed_layout(data: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((str(name), tuple(int(x) for x in shape)) for name, shape in data)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _show(value: object) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
