"""The batch-invariant op layer's own parts: call shaping, the calibration probe, the remembered plans,
and what the engine does when the start-up self-check fails."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache import Engine
from hicache.errors import UserError
from hicache.model import build as model_build
from hicache.model.kernels import key_blocks, ops
from hicache.model.kernels.calibration import LinearPlanner, plan_passes, probe_operands, rows_stack
from hicache.model.kernels.invariance import InvarianceReport
from hicache.model.loading.loader import load_model
from hicache.parallel.parallel import ParallelContext


class RowCountDependent(ops.LinearBackend):
    """A GEMM whose one-row calls round differently: what MKL does on some CPUs, made certain. The
    other calls compute each row alone, in one identical reduction: invariant by construction."""

    name = "row_count_dependent"

    def available(self, dtype, device) -> bool:
        return False  # never a calibration candidate; only used where a test names it

    def prepare(self, weight, dtype):
        return weight

    def run(self, prepared, x):
        out = torch.cat([F.linear(row[None], prepared) for row in x])
        return out + out.abs() * 2**-20 if x.shape[0] == 1 else out


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 70),
    plan=st.sampled_from([ops.LinearPlan("aten", g) for g in (1, 2, 4, 8, 16)] + [ops.LinearPlan("aten", tile=8)]),
)
def test_shaped_call_returns_every_row_once_in_order(m, plan):
    # Small integers make every product and sum exact, so any row mix-up shows as a wrong value.
    x = torch.randint(-3, 4, (m, 5)).float()
    w = torch.randint(-3, 4, (7, 5)).float()
    calls = []

    def run(rows):
        calls.append(rows.shape[0])
        return F.linear(rows, w)

    assert torch.equal(ops.shaped_call(run, plan, x), x @ w.T)
    if plan.tile:
        assert set(calls) == {plan.tile}  # every call is exactly one tile
    else:
        assert all(c % plan.granule == 0 for c in calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_operands_make_a_changed_summation_order_show(dtype):
    """The calibration probe is only as good as its operands: summing the same products in another
    order must change most outputs, in bf16 too (plain random data would hide it there)."""
    weight, x = probe_operands(64, 576, 8, dtype, torch.device("cpu"))
    products = x.float()[:, None, :] * weight.float()[None, :, :]  # exact: bf16 x bf16 fits in fp32
    forward = products.sum(-1, dtype=torch.float32)
    blocked = products.view(8, 64, 36, 16).sum(-1).sum(-1)  # 16 lanes, then across: a SIMD-style order
    changed = (forward.to(dtype) != blocked.to(dtype)).float().mean()
    assert changed > 0.5, f"only {changed:.0%} of outputs show the reordering"


def test_calibration_rejects_a_row_count_dependent_gemm(monkeypatch):
    monkeypatch.setitem(ops.BACKENDS, RowCountDependent.name, RowCountDependent())
    shape, cpu = (64, 96), torch.device("cpu")
    assert not plan_passes(shape, torch.float32, cpu, ops.LinearPlan(RowCountDependent.name, 1))
    assert plan_passes(shape, torch.float32, cpu, ops.LinearPlan(RowCountDependent.name, 2))
    assert plan_passes(shape, torch.float32, cpu, ops.LinearPlan(RowCountDependent.name, tile=16))


class ColumnBlockDependent(ops.LinearBackend):
    """A GEMM whose outputs past the first 64 columns of a call are summed in another order, as a
    kernel's remainder path over the weight's rows would: made certain."""

    name = "column_block_dependent"

    def available(self, dtype, device) -> bool:
        return False

    def prepare(self, weight, dtype):
        return weight

    def run(self, prepared, x):
        out = F.linear(x, prepared)
        out[:, 64:] = F.linear(x.flip(-1), prepared[64:].flip(-1))  # the same products, summed backwards
        return out


def test_weights_stack_into_one_call_only_where_each_keeps_its_bits(monkeypatch, tmp_path):
    """TP's column groups (hicache/model/kernels/tp_groups.py) run as one call only where that call gives every
    group the bits of the group's own call: the bits a rank holding one group computes."""
    monkeypatch.setitem(ops.BACKENDS, ColumnBlockDependent.name, ColumnBlockDependent())
    plan, cpu = ops.LinearPlan(ColumnBlockDependent.name, 1), torch.device("cpu")
    assert rows_stack((32, 96), 2, torch.float32, cpu, plan, plan)  # 64 columns: one block, one order
    assert not rows_stack((64, 96), 2, torch.float32, cpu, plan, plan)  # the second group's columns differ
    planner = LinearPlanner(cpu, torch.float32, tmp_path)  # with the plans measured for both shapes
    alone, stacked = planner.plan((64, 96)), planner.plan((192, 96))
    assert planner.rows_stack((64, 96), 3) == rows_stack((64, 96), 3, torch.float32, cpu, alone, stacked)


def test_plans_are_remembered_per_platform_and_a_broken_file_is_measured_again(tmp_path):
    cpu = torch.device("cpu")
    weight = (32, 64)
    planner = LinearPlanner(cpu, torch.float32, tmp_path)
    plan = planner.plan(weight)
    saved = json.loads(planner.path.read_text())
    assert saved == {"float32:32x64": {"backend": plan.backend, "granule": plan.granule, "tile": plan.tile}}
    assert planner.fingerprint in planner.path.name
    assert LinearPlanner(cpu, torch.float32, tmp_path).plan(weight) == plan  # read back, not measured
    planner.path.write_text("{not json")
    assert LinearPlanner(cpu, torch.float32, tmp_path).plan(weight) == plan


@pytest.mark.slow
def test_a_stale_remembered_plan_is_measured_again_when_the_self_check_fails(monkeypatch, tmp_path):
    """A plans file from another state of the machine must not stand between a user and the cache."""
    monkeypatch.setitem(ops.BACKENDS, RowCountDependent.name, RowCountDependent())
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path))
    loaded = load_model("tiny")
    cpu = torch.device("cpu")
    model_build.build_decoder(loaded, ParallelContext(), torch.float32, cpu)  # measures every shape
    planner = LinearPlanner(cpu, torch.float32)
    stale = {"backend": RowCountDependent.name, "granule": 1, "tile": 0}
    planner.path.write_text(json.dumps({key: stale for key in json.loads(planner.path.read_text())}))
    model = model_build.build_decoder(loaded, ParallelContext(), torch.float32, cpu)
    assert model.invariance.verified, model.invariance.detail
    assert RowCountDependent.name not in planner.path.read_text()


def test_engine_refuses_a_cache_where_the_self_check_fails(monkeypatch):
    failed = InvarianceReport(False, {}, "chunks of 1-10 rows: max |diff| 1e-06")
    monkeypatch.setattr(model_build, "self_check", lambda model: failed)
    with pytest.raises(UserError, match="self-check failed on this machine.*--disable-radix-cache"):
        Engine(model="tiny")
    # Without a cache there is nothing to protect: it serves, and says what it found.
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        assert engine.invariance == {"verified": False, "mechanisms": {}, "detail": failed.detail,
                                     "thread_count_invariant": True}
        assert engine.generate([[5, 6, 7]])[0].token_ids


def test_engine_reports_the_verified_mechanisms():
    with Engine(model="tiny") as engine:
        report = engine.invariance
    assert report["verified"] is True and report["detail"] == ""
    assert report["mechanisms"]["attention"].startswith(f"blocks of {key_blocks.KV_BLOCK} keys")
    assert set(report["mechanisms"]) >= {"linear qkv_proj", "linear down_proj", "linear lm_head"}
