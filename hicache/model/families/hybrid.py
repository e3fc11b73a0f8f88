"""A hybrid decoder (docs/DESIGN.md, "hybrid models"), the shape of `tiny-hybrid`: Llama-family layers of
three kinds, as a checkpoint's `layer_types` lists them (Hugging Face's names):

- `full_attention`: the Llama layer, attending over every earlier token;
- `sliding_attention`: the same projections and RoPE, each row attending over its last `sliding_window`
  keys only (itself included);
- `linear_attention`: a gated linear-attention layer with a recurrent state per head,
  S_t = g_t * S_{t-1} + k_t v_t^T and o_t = q_t S_t, g_t = sigmoid(W_g x_t + b) in (0, 1): the state after
  token t depends on every token before it, and no part of the prefix rebuilds it.

What the prefix cache keeps of a linear-attention layer, in the pool row of each token (so host copies move it
with the KV, as they move `shift.py`'s state): the token's projected k, v and gate (`linear_k`, `linear_v`,
`linear_gate`), and a share of a state snapshot (`linear_state`), in the row's first columns: those that
attention layers fill with K and V (`linear_layout`), so a row is no wider than attention's where they
fit (tiny-hybrid: 98 of 128). At every page boundary a request crosses,
the state after the page's last token is stored across that page's last SNAPSHOT_ROWS rows. The state
before any position p is then the snapshot at the page boundary B <= p, replayed over the stored k, v and
gates of tokens B..p-1 (fewer than a page): a forward pass reads it from the pool for every sequence, a
decode step as a prefill chunk, a cache hit (which ends on a page boundary) as a new request's own
pages. Every input of the scan comes from the pool, and the snapshot is rounded to the pool's dtype in
every run alike, so the scan sees the same bits whether the prefix was computed or served from a cache.

Sliding-window layers keep their K and V in a pool of their own pages, mapped from the full pages
(hicache/mem/sliding_pool.py; the pool translates their slots), which the cache frees outside the window
(hicache/cache/sliding_tier.py).

The window attention and the scan are the fixed-order ops of hicache/model/kernels/ordered.py; the
projections go through the batch-invariant linears like every other family's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVComponent, KVLayout
from hicache.model.batch import ForwardBatch
from hicache.model.config import ModelConfig
from hicache.model.families.llama import DecoderLayer, LlamaLayer, LlamaModel, MakeLinear
from hicache.model.kernels import ordered
from hicache.model.rope import RotaryEmbedding
from hicache.parallel.parallel import ParallelContext

FAMILY = "hybrid"  # LoadedModel.family of this decoder (hicache/model/families/registry.py)
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LINEAR_K, LINEAR_V, LINEAR_GATE, LINEAR_STATE = "linear_k", "linear_v", "linear_gate", "linear_state"
# Rows of a page one state snapshot is spread over: the page size must be at least this (refused below it,
# hicache/engine/build.py). More rows make each row's share smaller.
SNAPSHOT_ROWS = 16
WINDOW_PIECE = 256  # rows whose window keys one call of window attention holds (memory: rows x window x row)


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """A Llama shape plus, per layer, its kind (`layer_types`), the sliding window in tokens, and the
    linear-attention layers' heads and head size (keys and values alike)."""

    layer_types: tuple[str, ...] = ()
    sliding_window: int = 64
    linear_num_heads: int = 2
    linear_head_dim: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}")
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING, LINEAR})
        if unknown:
            raise ValueError(f"unknown layer types {unknown}: use {FULL}, {SLIDING} or {LINEAR}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.state_numel % SNAPSHOT_ROWS:
            raise ValueError(f"a linear-attention state of {self.state_numel} values does not split over "
                             f"{SNAPSHOT_ROWS} rows")  # fmt: skip

    @property
    def state_numel(self) -> int:
        """Values of one linear-attention layer's recurrent state: heads x dk x dv."""
        return self.linear_num_heads * self.linear_head_dim**2


def has_recurrent_layers(config: ModelConfig) -> bool:
    """Whether a model's config has linear-attention layers, whose state the cache keeps in snapshots."""
    return isinstance(config, HybridConfig) and LINEAR in config.layer_types


def linear_attention_names(layer: int) -> dict[str, str]:
    a = f"model.layers.{layer}.linear_attn."
    return {p: a + p + ".weight" for p in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "gate_bias")}


class LinearAttentionLayer(DecoderLayer):
    """The MLP and norms of every layer, with the gated linear attention's projections in place of
    attention's (weights `linear_attn.{q,k,v,g,o}_proj` and the gate's bias `linear_attn.gate_bias` [heads])."""

    def __init__(self, cfg: HybridConfig, w: dict[str, torch.Tensor], prefix: str, index: int,
                 pctx: ParallelContext, cast, linear, groups: int):  # fmt: skip
        super().__init__(cfg, w, prefix, pctx, cast, linear, groups)
        names = linear_attention_names(index)
        self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.o_proj = (
            linear(w[names[p]]) for p in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj"))  # fmt: skip
        self.gate_bias = cast(w[names["gate_bias"]]).float()


@dataclass
class ScanPlan:
    """Where one forward pass's linear-attention scan reads and writes, for every layer of that kind.
    Sequence n's steps are its positions B_n .. end-1 (B_n the page boundary at or before its first new
    token): `slots` [N, S] their pool slots (slot 0 past its end, `valid` False there); `stored` [N, S]
    the steps after which a snapshot is kept. `restore_rows` [M * R]: the rows of the snapshots at B_n of
    the M sequences `restore_seqs` whose B_n > 0. `readout` [T]: each batch row's step as n * S + s.
    `store_rows` [K * R] and `store_steps` [K]: where each snapshot this pass crosses goes, and its step."""

    slots: torch.Tensor
    valid: torch.Tensor
    stored: torch.Tensor
    restore_rows: torch.Tensor
    restore_seqs: torch.Tensor
    readout: torch.Tensor
    store_rows: torch.Tensor
    store_steps: torch.Tensor


def plan_scan(batch: ForwardBatch, page_size: int, device: torch.device) -> ScanPlan:
    """The scan of `batch`'s sequences with snapshots at every page boundary."""
    R, spans = SNAPSHOT_ROWS, []
    for seq in batch.seqs:
        first = seq.kv_len - seq.length
        spans.append(((first // page_size) * page_size, first, seq.kv_len))
    S = max(end - base for base, _, end in spans)
    slots = torch.zeros(len(spans), S, dtype=torch.int64, device=device)
    steps = torch.arange(S, device=device)
    valid = torch.zeros(len(spans), S, dtype=torch.bool, device=device)
    stored = torch.zeros_like(valid)
    readout = torch.empty(batch.num_tokens, dtype=torch.int64, device=device)
    restore_rows, restore_seqs, store_rows, store_steps = [], [], [], []
    for n, (seq, (base, first, end)) in enumerate(zip(batch.seqs, spans)):
        slots[n, : end - base] = seq.kv_slots[base:end]
        valid[n, : end - base] = True
        stored[n] = valid[n] & ((base + steps + 1) % page_size == 0)
        if base > 0:
            restore_rows.append(seq.kv_slots[base - R : base])
            restore_seqs.append(n)
        readout[seq.start : seq.start + seq.length] = n * S + first - base + torch.arange(seq.length, device=device)
        for boundary in range(base + page_size, end + 1, page_size):
            store_rows.append(seq.kv_slots[boundary - R : boundary])
            store_steps.append(n * S + boundary - base - 1)

    def index(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else index([])

    return ScanPlan(slots, valid, stored, joined(restore_rows), index(restore_seqs), readout,
                    joined(store_rows), index(store_steps))  # fmt: skip


def plan_windows(batch: ForwardBatch, window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per batch row, the slots of its window's keys [T, W] (oldest first, slot 0 before the sequence's
    start) and which of them exist [T, W]."""
    offsets = torch.arange(window, device=device) - (window - 1)
    slots = torch.zeros(batch.num_tokens, window, dtype=torch.int64, device=device)
    visible = torch.zeros(batch.num_tokens, window, dtype=torch.bool, device=device)
    for seq in batch.seqs:
        positions = torch.arange(seq.kv_len - seq.length, seq.kv_len, device=device).unsqueeze(1) + offsets
        rows = slice(seq.start, seq.start + seq.length)
        visible[rows] = positions >= 0
        slots[rows] = seq.kv_slots.to(device)[positions.clamp(min=0)]
    return slots, visible


class HybridModel(LlamaModel):
    """One rank's hybrid decoder (implements `hicache.model.base.DecoderModel`); `cfg.layer_types` says
    each layer's kind."""

    page_shardable = False  # a row reads other tokens' state rows, which CP may hold on another rank
    per_layer = (*LlamaModel.per_layer, "layer_types")
    cfg: HybridConfig

    _local_rope: RotaryEmbedding | None = None  # sliding layers' own, where they have one (_layer_rope)

    def _build_own(self, weights: dict[str, torch.Tensor], make_linear: MakeLinear) -> None:
        cfg = self.cfg
        self.layer_types = cfg.layer_types[self.layer_range[0] : self.layer_range[1]]
        heads, dim = cfg.linear_num_heads, cfg.linear_head_dim
        snapshot_share = cfg.state_numel // SNAPSHOT_ROWS
        # A linear-attention layer's row: its own columns from the row's start, over the K and V columns
        # that only attention layers use. The pool has one row width for every layer; it grows only by
        # what these need beyond attention's.
        own = (
            (LINEAR_K, (heads, dim)),
            (LINEAR_V, (heads, dim)),
            (LINEAR_GATE, (heads,)),
            (LINEAR_STATE, (snapshot_share,)),
        )
        self.linear_layout = KVLayout(tuple(KVComponent(name, shape) for name, shape in own))
        beyond = self.linear_layout.row_numel - self.kv_layout.row_numel
        if LINEAR in self.layer_types and beyond > 0:
            self.kv_layout = KVLayout(self.kv_layout.components + (KVComponent("linear_rest", (beyond,)),))
        self._step: tuple[torch.Tensor, ScanPlan | None, tuple[torch.Tensor, torch.Tensor] | None] | None = None

    @property
    def sliding_layers(self) -> frozenset[int]:
        """This rank's sliding-window layers (local indices): their rows live in a pool of their own."""
        return frozenset(i for i, kind in enumerate(self.layer_types) if kind == SLIDING)

    def _build_layer(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, cast, linear) -> DecoderLayer:
        assert isinstance(cfg, HybridConfig)
        index = int(prefix.split(".")[2])
        if cfg.layer_types[index] == LINEAR:
            return LinearAttentionLayer(cfg, w, prefix, index, self.pctx, cast, linear, self.tp_groups)
        return LlamaLayer(cfg, w, prefix, self.pctx, cast, linear, self.tp_groups)

    def _layer_rope(self, index: int) -> RotaryEmbedding:
        """Sliding-window layers rotate by their own base where the family gives one (Gemma 3's 10,000, without
        the global layers' scaling)."""
        theta = self.cfg.parts.local_rope_theta
        if theta is None or self.cfg.layer_types[index] != SLIDING:
            return self.rope
        if self._local_rope is None:
            self._local_rope = RotaryEmbedding(self._rope_dim(), theta, None, self.device)
        return self._local_rope

    def linear_plans(self) -> dict[str, str]:
        plans = super().linear_plans() if isinstance(self.layers[0], LlamaLayer) else {}
        for layer in self.layers:
            if isinstance(layer, LinearAttentionLayer):
                names = ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")
                plans.update({f"linear_attn.{n}": getattr(layer, n).plan.describe() for n in names})
                break
        return plans

    def forward(self, batch: ForwardBatch, pool: DeviceKVPool, hidden: torch.Tensor | None = None) -> torch.Tensor:
        scan = plan_scan(batch, pool.page_size, self.device) if LINEAR in self.layer_types else None
        windows = plan_windows(batch, self.cfg.sliding_window, self.device) if SLIDING in self.layer_types else None
        self._step = (batch.out_slots.to(self.device), scan, windows)
        try:
            return super().forward(batch, pool, hidden)
        finally:
            self._step = None

    def _attention(self, local: int, layer, x: torch.Tensor, positions: torch.Tensor, meta, pool) -> torch.Tensor:
        kind = self.layer_types[local]
        if kind == FULL:
            return super()._attention(local, layer, x, positions, meta, pool)
        assert self._step is not None, "a layer runs only inside forward"
        out_slots, scan, windows = self._step
        if kind == SLIDING:
            assert windows is not None
            return self._window_attention(local, layer, x, positions, out_slots, windows, pool)
        assert scan is not None
        return self._linear_attention(local, layer, x, out_slots, scan, pool)

    def _window_attention(self, local: int, layer: LlamaLayer, x: torch.Tensor, positions: torch.Tensor,
                          out_slots: torch.Tensor, windows: tuple[torch.Tensor, torch.Tensor],
                          pool: DeviceKVPool) -> torch.Tensor:  # fmt: skip
        """Sliding-window attention: the step's K and V go into the pool, then each row attends over its
        window read back from it (rows in pieces, so a long prefill chunk holds a piece's windows)."""
        q, k, v = self._qkv(layer, x, positions)
        pool.write(local, out_slots, {"k": k, "v": v})
        slots, visible = windows
        T, W = slots.shape
        pieces = []
        for a in range(0, T, WINDOW_PIECE):
            rows = slice(a, min(T, a + WINDOW_PIECE))
            keys, values = self._expand(pool.read_rows(local, slots[rows].reshape(-1)))
            n = keys.shape[0] // W
            pieces.append(ordered.window_attention(q[rows], keys.view(n, W, *keys.shape[1:]),
                                                   values.view(n, W, *values.shape[1:]), visible[rows],
                                                   self.cfg.attention_scale))  # fmt: skip
        return torch.cat(pieces).reshape(T, -1)

    def _linear_attention(self, local: int, layer: LinearAttentionLayer, x: torch.Tensor, out_slots: torch.Tensor,
                          scan: ScanPlan, pool: DeviceKVPool) -> torch.Tensor:  # fmt: skip
        """Gated linear attention: the step's k, v and gate go into the pool; each sequence's state is its
        snapshot at the page boundary before its new tokens, scanned over the pool's rows from there."""
        T, heads, dim = x.shape[0], self.cfg.linear_num_heads, self.cfg.linear_head_dim
        q = layer.q_proj(x).view(T, heads, dim) * dim**-0.5
        gate = ordered.whole_vectors(torch.sigmoid, layer.g_proj(x).float() + layer.gate_bias)
        keys = layer.k_proj(x).view(T, heads * dim) * dim**-0.5
        pool.write_columns(local, out_slots, 0, torch.cat([keys, layer.v_proj(x), gate.to(keys.dtype)], dim=1))
        N, S = scan.slots.shape
        rows = self.linear_layout.unpack(pool.read_rows(local, scan.slots.view(-1))[:, : self.linear_layout.row_numel])
        valid = scan.valid.view(N, S, 1)  # past a sequence's end: key 0 and gate 1 keep its state
        keys = torch.where(valid.unsqueeze(-1), rows[LINEAR_K].view(N, S, heads, dim).float(), 0.0)
        values = torch.where(valid.unsqueeze(-1), rows[LINEAR_V].view(N, S, heads, dim).float(), 0.0)
        gates = torch.where(valid, rows[LINEAR_GATE].view(N, S, heads).float(), 1.0)
        state = torch.zeros(N, heads, dim, dim, dtype=torch.float32, device=self.device)
        if scan.restore_seqs.numel():
            restored = self.linear_layout.unpack(pool.read_rows(local, scan.restore_rows))[LINEAR_STATE]
            state[scan.restore_seqs] = restored.reshape(-1, heads, dim, dim).float()
        states = ordered.gated_scan(state, keys, values, gates, scan.stored, self.dtype).view(N * S, heads, dim, dim)
        if scan.store_steps.numel():
            snapshots = states[scan.store_steps].to(self.dtype).reshape(-1, self.cfg.state_numel // SNAPSHOT_ROWS)
            pool.write_columns(local, scan.store_rows, self.linear_layout.span(LINEAR_STATE)[0], snapshots)
        return ordered.state_readout(q, states[scan.readout]).reshape(T, heads * dim)  # `_layer` projects it
