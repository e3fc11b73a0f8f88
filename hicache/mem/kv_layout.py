"""What one token's KV is made of, per layer, independent of the attention flavour.

A pool stores one row per token slot per layer; the layout names the components packed into that row.
MHA/GQA has K and V of shape (kv_heads, head_dim); MLA has one latent vector (and its rotary key part);
state that lives beside the KV per token (an indexer key, a token-shift or convolution state) is one
more component, written by the layer that owns it.
Pools, host tiers and storage only ever move whole rows, so they never need to know the flavour.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVComponent:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class KVLayout:
    components: tuple[KVComponent, ...]

    @classmethod
    def mha(cls, kv_heads: int, head_dim: int) -> "KVLayout":
        return cls((KVComponent("k", (kv_heads, head_dim)), KVComponent("v", (kv_heads, head_dim))))

    @classmethod
    def mla(cls, latent_dim: int, rope_dim: int) -> "KVLayout":
        """MLA (DeepSeek-style): one compressed latent vector per token and the shared rotary key part;
        the same bytes serve every attention head, so every attention-TP rank would hold the same row."""
        return cls((KVComponent("latent", (latent_dim,)), KVComponent("rope", (rope_dim,))))

    @functools.cached_property
    def row_numel(self) -> int:
        return sum(c.numel for c in self.components)

    @functools.cached_property
    def _spans(self) -> tuple[tuple[str, int, int, tuple[int, ...]], ...]:
        """(name, offset, numel, shape) of each component: `unpack` runs twice a layer every step."""
        spans, offset = [], 0
        for c in self.components:
            spans.append((c.name, offset, c.numel, c.shape))
            offset += c.numel
        return tuple(spans)

    def span(self, name: str) -> tuple[int, int]:
        """(offset, numel) of component `name` within a row."""
        offset = 0
        for c in self.components:
            if c.name == name:
                return offset, c.numel
            offset += c.numel
        raise KeyError(f"no KV component {name!r} in {[c.name for c in self.components]}")

    def describe(self) -> str:
        """The row's components and shapes, e.g. "k(2, 32)+v(2, 32)": what `packed` compares."""
        return "+".join(f"{c.name}{c.shape}" for c in self.components)

    def pack(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """[T, *shape] per component -> [T, row_numel]."""
        return torch.cat([parts[c.name].reshape(parts[c.name].shape[0], c.numel) for c in self.components], dim=1)

    def unpack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """[T, row_numel] -> views [T, *shape] per component."""
        count = rows.shape[0]
        return {name: rows[:, offset : offset + numel].view(count, *shape) for name, offset, numel, shape in self._spans}
