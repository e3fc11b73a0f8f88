"""Topology of one rank: which layers and which KV heads it holds, and the process groups it talks on.

World size 1 is the default topology, not a special code path: every collective below is an identity
when its group has one member, so the single-rank engine runs the same code as a TP/PP deployment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items are split as evenly as possible into `parts`,
    earlier parts taking the remainder (so layer counts per PP stage differ by at most one)."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} outside 0..{parts - 1}")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ParallelContext:
    """Ranks are laid out PP-major: rank = pp_rank * tp_size + tp_rank.

    Groups (None at one rank; built by hicache.dist.launch). Compute groups carry activations; the
    gloo "cpu" groups carry small control messages, so agreement never queues behind a compute
    collective, and the storage threads have a group of their own because collectives on one group
    must be issued in the same order on every rank, which two threads of one rank cannot promise.
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None  # this stage's TP ranks: the all-reduces after o_proj and down_proj
    tp_cpu_group: Any = None  # the same ranks, gloo: MIN of ready ACK counts
    pp_group: Any = None  # this TP index's stages: hidden states
    pp_cpu_group: Any = None  # the same ranks, gloo: agreed counts sent down the pipeline (pp_sync)
    world_group: Any = None  # every rank, gloo: requests, sampled tokens, control, the consensus checker
    storage_group: Any = None  # every rank, gloo, used only by the storage threads: hit and read MINs

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    @property
    def prev_stage_rank(self) -> int:
        """Global rank of this TP index on the previous stage."""
        return self.rank_of(self.pp_rank - 1, self.tp_rank)

    @property
    def next_stage_rank(self) -> int:
        return self.rank_of(self.pp_rank + 1, self.tp_rank)

    @property
    def sampling_rank(self) -> int:
        """The one rank that samples next tokens (last stage, first TP rank) and shares them."""
        return self.rank_of(self.pp_size - 1, 0)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        if num_layers < self.pp_size:
            raise ValueError(f"{num_layers} layers cannot be split over {self.pp_size} pipeline stages")
        return split_range(num_layers, self.pp_size, self.pp_rank)

    def shard_range(self, count: int, what: str) -> tuple[int, int]:
        """This TP rank's contiguous share of `count` heads or columns; refuses uneven splits."""
        if count % self.tp_size:
            raise ValueError(f"{what}={count} is not divisible by tp_size={self.tp_size}")
        per = count // self.tp_size
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def all_reduce_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            torch.distributed.all_reduce(tensor, group=self.tp_group)
        return tensor

    @property
    def suffix(self) -> str:
        """Identifies this rank's shard of the KV in storage keys."""
        return f"tp{self.tp_rank}of{self.tp_size}_pp{self.pp_rank}of{self.pp_size}"
