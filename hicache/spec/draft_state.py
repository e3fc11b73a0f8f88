"""Where a draft's state lives beside the target's (docs/DESIGN.md, "Speculative decoding: the draft's
state"), chosen once at start-up by `--hicache-draft-layout`.

The draft always has device pools of its own, indexed by the target's logical pages (so the tree's
pages mean both models' state). Its host copy is either

- packed: its layers appended to the target's host pool, sharing the slot mapping. A host row then has
  to mean the same thing for both: the same row shape (components and their shapes), dtype and token
  indexing; a mismatch is refused, naming the field;
- sidecar: a host pool of its own row and dtype, following the target's host page ids.

`auto` packs when the geometries agree and takes a sidecar otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVGeometry:
    """What a host row of a pool is. Field names are what a refusal names."""

    row_shape: str  # the components and their shapes, e.g. "k(2, 32)+v(2, 32)"
    dtype: str
    token_indexing: str  # how rows map to tokens

    @classmethod
    def of(cls, pool: DeviceKVPool) -> KVGeometry:
        return cls(
            row_shape=pool.layout.describe(),
            dtype=str(pool.dtype).removeprefix("torch."),
            token_indexing=f"one row per token slot, pages of {pool.page_size}",
        )

    def mismatch(self, other: KVGeometry) -> str | None:
        """The first field that differs, as "field: ours vs theirs"; None when packing is possible."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                return f"{f.name.replace('_', ' ')}: {mine} vs the target's {theirs}"
        return None


def choose_layout(requested: str, draft: KVGeometry, target: KVGeometry) -> str:
    """The layout (packed or sidecar) for `--hicache-draft-layout requested` (auto, packed or sidecar)."""
    mismatch = draft.mismatch(target)
    if requested == "packed" and mismatch is not None:
        raise UserError(
            f"--hicache-draft-layout packed: the draft's {mismatch}; its layers cannot share the target's "
            "host rows (use sidecar or auto)"
        )
    layout = requested if requested != "auto" else ("sidecar" if mismatch else "packed")
    logger.info("draft state layout: %s%s", layout, f" ({mismatch})" if mismatch and requested == "auto" else "")
    return layout
