"""Which of a rank's layers the start-up self-check runs: one of each distinct kind of layer.

The batch-invariant ops choose their kernels and call shapes from shapes, dtypes, plans, thread counts
and the ISA, never from the values they compute on (kernels/ops.py, csrc/). Two layers whose parts have
the same types, shapes, dtypes and linear plans therefore make the same kernel calls with the same shapes
in every run of the probe, and round alike whatever the weights hold: probing the first of them tells
what probing the second would. So the probe runs the first layer of each distinct `kernel_signature` (a
Llama model: its first layer; a hybrid: its first sliding, linear-attention and full-attention layer; a
layer whose weights a checkpoint keeps in another format: that one too), and the final norm and head
after them, instead of every layer: its cost no longer grows with the model's depth.

A family names the attributes that hold one entry per local layer (`per_layer`: its layers, and e.g. a
hybrid's layer kinds); the probe runs a shallow copy of the model over the representatives' entries, so
the model that serves is never altered, whatever the probe does.

Every TP and CP rank picks the same layers: a plan is measured per weight shape and format on each rank,
so two layers differ on one rank exactly where they differ on every rank, and the probe's collectives
still pair up. Each pipeline stage picks among its own layers.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable

import torch

from hicache.model.base import DecoderModel
from hicache.model.kernels import ops


def kernel_signature(part: object) -> Hashable:
    """What decides the kernels a model part runs and the shapes of their calls; never its values. The
    model's own objects (layers, TP groups) are described by what they hold, anything else by its type."""
    if isinstance(part, torch.Tensor):
        return ("tensor", tuple(part.shape), part.dtype, part.device.type)
    if isinstance(part, ops.Linear):
        return ("linear", part.out_features, part.in_features, part.weight_format, part.plan)
    if isinstance(part, (list, tuple)):
        return tuple(kernel_signature(p) for p in part)
    if part is None or isinstance(part, (str, int, float, bool)):
        return part
    held = getattr(part, "__dict__", None)
    if held is None or not type(part).__module__.startswith("hicache.model."):
        return type(part).__qualname__
    return type(part).__qualname__, tuple((name, kernel_signature(value)) for name, value in sorted(held.items()))


def representative_layers(model: DecoderModel) -> list[int]:
    """The local index of the first layer of each distinct kernel signature, in layer order."""
    entries = {name: getattr(model, name) for name in model.per_layer}
    for name, values in entries.items():
        if len(values) != model.num_local_layers:
            raise ValueError(f"{type(model).__name__}.{name} holds {len(values)} entries for "
                             f"{model.num_local_layers} layers")  # fmt: skip
    seen: set[Hashable] = set()
    picked = []
    for local in range(model.num_local_layers):
        signature = tuple(kernel_signature(values[local]) for values in entries.values())
        if signature not in seen:
            seen.add(signature)
            picked.append(local)
    return picked


def over_layers(model: DecoderModel, layers: list[int]) -> DecoderModel:
    """A shallow copy of `model` whose per-layer attributes hold `layers`' entries only: it runs those
    layers (as local layers 0, 1, ..), then the final norm and head; `model` itself is untouched."""
    view = copy.copy(model)
    for name in model.per_layer:
        values = getattr(model, name)
        setattr(view, name, type(values)(values[local] for local in layers))
    return view
