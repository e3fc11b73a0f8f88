"""Parallel axes (docs/DESIGN.md, "parallel axes"): which layers and which KV heads a rank holds, and the process
groups it talks on, over three named axes: pipeline (pp), context (cp) and tensor (tp) parallelism.

`Mesh` holds the axis sizes and the one rank formula; `ParallelContext` is one rank's place in it and its
groups, one pair per axis. World size 1 is the default topology, not a special code path: every collective
below is an identity when its group has one member, so the single-rank engine runs the same code as a
TP/PP deployment. Context parallelism (--cp-size) shares a stage's tree between its CP and TP ranks
(`tree_cpu_group`, where cache decisions are agreed) and shards KV pages over the CP ranks
(hicache/parallel/placement.py); cp is absent from every user-facing name while it is 1.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import torch.distributed as dist

# Slowest-varying first: ranks are laid out PP-major, TP fastest, so a TP group is a run of consecutive
# ranks (one node's GPUs, for the all-reduces) and a pipeline stage is a contiguous block of ranks.
AXES = ("pp", "cp", "tp")


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items are split as evenly as possible into `parts`,
    earlier parts taking the remainder (so layer counts per PP stage differ by at most one)."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} outside 0..{parts - 1}")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class Mesh:
    """Axis sizes and the one rank formula: rank = (pp * cp_size + cp) * tp_size + tp."""

    pp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if self.size(axis) < 1:
                raise ValueError(f"{axis} size must be >= 1, got {self.size(axis)}")

    def size(self, axis: str) -> int:
        if axis not in AXES:
            raise ValueError(f"unknown parallel axis {axis!r} (axes: {', '.join(AXES)})")
        return getattr(self, axis)

    @property
    def world_size(self) -> int:
        return self.pp * self.cp * self.tp

    def rank_of(self, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        coords = {"pp": pp, "cp": cp, "tp": tp}
        rank = 0
        for axis in AXES:  # mixed radix, slowest axis first
            if not 0 <= coords[axis] < self.size(axis):
                raise ValueError(f"{axis} index {coords[axis]} outside 0..{self.size(axis) - 1}")
            rank = rank * self.size(axis) + coords[axis]
        return rank

    def coords_of(self, rank: int) -> dict[str, int]:
        """The inverse of `rank_of`: {"pp": ..., "cp": ..., "tp": ...}."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        coords = {}
        for axis in reversed(AXES):
            rank, coords[axis] = divmod(rank, self.size(axis))
        return {axis: coords[axis] for axis in AXES}

    def groups(self, *axes: str) -> list[list[int]]:
        """The ranks that differ only in `axes`, one list per setting of the other axes (in rank order of
        their first member): a partition of every rank."""
        others = [a for a in AXES if a not in axes]
        groups = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            coords = dict(zip(others, fixed))
            varying = itertools.product(*(range(self.size(a)) for a in axes))
            groups.append(sorted(self.rank_of(**coords, **dict(zip(axes, v))) for v in varying))
        return sorted(groups)


@dataclass(frozen=True)
class AxisGroups:
    """One axis's groups of a rank: `compute` carries activations (NCCL on GPUs), `cpu` (gloo) carries
    small control messages, so agreement never queues behind a compute collective; `side` (compute
    backend, cp and tp only) carries the KV page gathers that run on their own thread beside the
    forward pass, since one group's collectives must be issued in one order, which two threads cannot
    promise."""

    compute: Any
    cpu: Any
    side: Any = None


@dataclass(frozen=True)
class ParallelContext:
    """One rank's coordinates on the mesh and its groups (`axis_groups`: one `AxisGroups` per axis of
    size > 1; none at one rank; built by `create`).

    Besides the per-axis groups: `world_group` (every rank, gloo) carries requests, sampled tokens,
    control and the consensus checker; `storage_group` (every rank, gloo) is used only by the storage
    threads, because collectives on one group must be issued in the same order on every rank, which two
    threads of one rank cannot promise.
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    # Process groups compare by identity at best: they take no part in equality or hashing.
    axis_groups: Mapping[str, AxisGroups] = field(default_factory=dict, compare=False)
    world_group: Any = field(default=None, compare=False)
    storage_group: Any = field(default=None, compare=False)
    stage_cpu_group: Any = field(default=None, compare=False)  # this stage's CP x TP ranks (cp > 1 only)

    def __post_init__(self) -> None:
        self.mesh.rank_of(**self.coords)  # refuses coordinates outside the mesh

    @classmethod
    def create(cls, rank: int, mesh: Mesh, compute_backend: str, timeout: timedelta) -> ParallelContext:
        """Build this rank's groups after `torch.distributed.init_process_group`. Every rank creates every
        group, in the same order (torch.distributed requires it), and keeps those it belongs to."""
        if dist.get_world_size() != mesh.world_size:
            raise ValueError(f"the job has {dist.get_world_size()} ranks but the mesh {mesh} has {mesh.world_size}")

        def group(ranks: list[int], backend: str) -> Any:
            return dist.new_group(ranks, backend=backend, timeout=timeout)

        everyone = list(range(mesh.world_size))
        world_group = group(everyone, "gloo")
        storage_group = group(everyone, "gloo")
        mine: dict[str, AxisGroups] = {}
        for axis in reversed(AXES):  # tp first: the creation order of earlier releases
            if mesh.size(axis) == 1:
                continue
            for ranks in mesh.groups(axis):
                side = group(ranks, compute_backend) if axis != "pp" else None
                pair = AxisGroups(group(ranks, compute_backend), group(ranks, "gloo"), side)
                if rank in ranks:
                    mine[axis] = pair
        stage_cpu_group = None
        if mesh.cp > 1:
            for ranks in mesh.groups("cp", "tp"):
                made = group(ranks, "gloo")
                if rank in ranks:
                    stage_cpu_group = made
        coords = mesh.coords_of(rank)
        return cls(
            tp_size=mesh.tp, tp_rank=coords["tp"], pp_size=mesh.pp, pp_rank=coords["pp"],
            cp_size=mesh.cp, cp_rank=coords["cp"],
            axis_groups=mine, world_group=world_group, storage_group=storage_group,
            stage_cpu_group=stage_cpu_group,
        )  # fmt: skip

    # ---- coordinates ---------------------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        return Mesh(pp=self.pp_size, cp=self.cp_size, tp=self.tp_size)

    @property
    def coords(self) -> dict[str, int]:
        return {"pp": self.pp_rank, "cp": self.cp_rank, "tp": self.tp_rank}

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def rank(self) -> int:
        return self.mesh.rank_of(**self.coords)

    def rank_of(self, pp_rank: int, tp_rank: int, cp_rank: int | None = None) -> int:
        """Global rank at these coordinates (this rank's CP index unless given)."""
        return self.mesh.rank_of(pp=pp_rank, cp=self.cp_rank if cp_rank is None else cp_rank, tp=tp_rank)

    @property
    def prev_stage_rank(self) -> int:
        """Global rank of this (CP, TP) index on the previous stage."""
        return self.rank_of(self.pp_rank - 1, self.tp_rank)

    @property
    def next_stage_rank(self) -> int:
        return self.rank_of(self.pp_rank + 1, self.tp_rank)

    @property
    def sampling_rank(self) -> int:
        """The one rank that samples next tokens (last stage, first CP and TP rank) and shares them."""
        return self.rank_of(self.pp_size - 1, 0, cp_rank=0)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_view(self) -> ParallelContext:
        """This rank's pipeline stage as a whole pipeline of one stage: the same TP and CP coordinates and
        groups, no PP axis. A model built on it holds every layer and ends with the logits on every
        rank of the stage, talking only to the stage's ranks (a speculative draft replicated on every
        stage, docs/DESIGN.md, "Speculative decoding on every topology"). Its `rank` is the rank within the
        stage; the world and storage groups stay the job's, for what a stage never sends on."""
        return dataclasses.replace(
            self, pp_size=1, pp_rank=0, axis_groups={a: g for a, g in self.axis_groups.items() if a != "pp"}
        )

    # ---- groups --------------------------------------------------------------------------------

    def group(self, axis: str) -> Any:
        """This rank's compute group along `axis` (None when the axis has one member)."""
        pair = self.axis_groups.get(axis)
        return pair.compute if pair is not None else None

    def cpu_group(self, axis: str) -> Any:
        """This rank's gloo group along `axis` (None when the axis has one member)."""
        pair = self.axis_groups.get(axis)
        return pair.cpu if pair is not None else None

    def side_group(self, axis: str) -> Any:
        """This rank's KV-gather group along `axis` (cp or tp; None when the axis has one member)."""
        pair = self.axis_groups.get(axis)
        return pair.side if pair is not None else None

    @property
    def tree_size(self) -> int:
        """Ranks that keep one radix tree in step: a stage's CP x TP ranks."""
        return self.cp_size * self.tp_size

    @property
    def tree_cpu_group(self) -> Any:
        """Those ranks, gloo: where cache decisions are agreed (MIN of ready ACK counts)."""
        return self.stage_cpu_group if self.cp_size > 1 else self.tp_cpu_group

    @property
    def tp_group(self) -> Any:
        """This stage's TP ranks: the all-reduces after o_proj and down_proj."""
        return self.group("tp")

    @property
    def tp_cpu_group(self) -> Any:
        """The same ranks, gloo: MIN of ready ACK counts."""
        return self.cpu_group("tp")

    @property
    def pp_group(self) -> Any:
        """This TP index's stages: hidden states."""
        return self.group("pp")

    @property
    def pp_cpu_group(self) -> Any:
        """The same ranks, gloo: agreed counts sent down the pipeline (pp_sync)."""
        return self.cpu_group("pp")

    # ---- the model's shard ---------------------------------------------------------------------

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

    @property
    def suffix(self) -> str:
        """Identifies this rank's shard of the KV in storage keys and logs. CP ranks hold different pages
        of the same shard, so cp appears only once it is used (keys written so far stay valid)."""
        cp = f"_cp{self.cp_rank}of{self.cp_size}" if self.cp_size > 1 else ""
        return f"tp{self.tp_rank}of{self.tp_size}_pp{self.pp_rank}of{self.pp_size}{cp}"
