"""Builds one rank's decoder on its batch-invariant ops, and checks the invariant on this machine.

Linear call shapes are measured per weight shape (calibration.py, remembered across restarts); the
assembled model then runs the start-up probe (invariance.py) and carries its report as
`model.invariance`. If the probe fails with remembered plans, they are measured again once: a stale
file must not stand between a user and the cache.
"""

from __future__ import annotations

import torch

from hicache.dist.parallel import ParallelContext
from hicache.dist.placement import kv_sharding
from hicache.model import ops
from hicache.model.calibration import LinearPlanner, NoInvariantPlan
from hicache.model.config import LoadedModel
from hicache.model.invariance import InvarianceReport, mechanisms, self_check
from hicache.model.llama import LlamaModel, PlanFor
from hicache.model.shift import ARCHITECTURE as TOKEN_SHIFT
from hicache.model.shift import TokenShiftModel

# LoadedModel.extra["architecture"] -> the decoder class (a Llama unless a loader says otherwise).
ARCHITECTURES: dict[str, type[LlamaModel]] = {"llama": LlamaModel, TOKEN_SHIFT: TokenShiftModel}
from hicache.model.mla import MLAConfig, MLAModel


def build_decoder(
    loaded: LoadedModel, pctx: ParallelContext, dtype: torch.dtype, device: torch.device, invariant: bool = True
) -> LlamaModel:
    """`invariant=False` builds the model on plain `F.linear` without padding, for benchmarks that
    measure what invariance costs; it is not checked (its report says so)."""

    ops.configure_device(device)
    if isinstance(loaded.config, MLAConfig):
        decoder: type[LlamaModel] = MLAModel
    else:
        decoder = ARCHITECTURES[str(loaded.extra.get("architecture", "llama"))]
    sharding = kv_sharding(pctx, decoder.replicated_over_tp)

    def build(plan_for: PlanFor) -> LlamaModel:
        return decoder(loaded.config, loaded.weights, pctx, dtype, device, plan_for, sharding)

    if not invariant:
        model = build(lambda w: ops.PLAIN)
        model.invariance = InvarianceReport(False, mechanisms(model), "plain ops (benchmark mode): not checked")
        return model
    planner = LinearPlanner(device, dtype)
    remembered = planner.path.exists()
    try:
        model = build(planner.plan)
    except NoInvariantPlan as exc:
        model = build(lambda w: ops.PLAIN)
        model.invariance = InvarianceReport(False, mechanisms(model), str(exc))
        return model
    model.invariance = self_check(model)
    # Only at one TP rank: TP ranks probe in lockstep (the sums are collectives), and whether a
    # plan file was there when each rank started is not something they agree on.
    if not model.invariance.verified and remembered and pctx.tp_size == 1:
        planner.forget()
        model = build(planner.plan)
        model.invariance = self_check(model)
    return model
