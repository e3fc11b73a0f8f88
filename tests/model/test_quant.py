"""Quantized weights: the GGUF's codes as the loader keeps them, the selections the model applies to
them, re-quantization, the packed kernels against their own dequantized weights, and the calibration
of their call shapes (which must see a reordering when there is one)."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import UserError
from hicache.model.build import CHECKPOINT, LinearFactory, kernel_available, resolve_quantization, with_weight_format
from hicache.model.kernels import native, ops, quant
from hicache.model.kernels.calibration import LinearPlanner, plan_passes
from hicache.model.loading.loader import load_model

CPU = torch.device("cpu")
BF16_KERNELS = all(kernel_available(fmt, torch.bfloat16, CPU) for fmt in quant.FORMATS)
# hicache's own kernels (kernels/native.py): fast with float32 activations too, so auto quantizes there.
NATIVE_KERNELS = all(ops.BACKENDS[f"native-{fmt}"].available(torch.float32, CPU) for fmt in quant.FORMATS)
needs_kernels = pytest.mark.skipif(not BF16_KERNELS, reason="no packed int4/int8 CPU kernels in this torch build")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.mark.slow
def test_gguf_codes_dequantize_to_the_loaded_weights(smollm2):
    # The kept codes are the file's: their values are bitwise the dequantized float32 weights
    # (after the q/k row permutation, which both follow).
    kinds = {w.source for w in smollm2.quantized.values()}
    assert kinds == {"Q4_1", "Q8_0"}
    assert len(smollm2.quantized) == 30 * 7 + 1  # every projection of every layer, and the embedding
    for name, q in smollm2.quantized.items():
        assert torch.equal(q.dequantize(), smollm2.weights[name]), name
    assert smollm2.quantized["model.layers.0.self_attn.q_proj.weight"].format == "int4"
    assert smollm2.quantized["model.embed_tokens.weight"].format == ""  # 32-blocks: int8 needs per-row scales


def _random_int4(n_groups_rows, n_groups_cols, seed) -> quant.QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    n, k = n_groups_rows * 16, n_groups_cols * quant.INT4_GROUP
    codes = torch.randint(0, 16, (n, k), generator=gen).to(torch.int8)
    scale = torch.rand(n, k // 32, generator=gen) + 0.01
    offset = torch.randn(n, k // 32, generator=gen)
    return quant.QuantizedWeight(codes, scale, offset, 32, 4, "Q4_1")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 4), seed=st.integers(0, 2**16),
       data=st.data())  # fmt: skip
def test_selections_commute_with_dequantization(rows, cols, seed, data):
    w = _random_int4(rows, cols, seed)
    dense = w.dequantize()
    n, k = w.shape
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    g0 = data.draw(st.integers(0, cols - 1))
    g1 = data.draw(st.integers(g0 + 1, cols))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(w[a:b].dequantize(), dense[a:b])
    assert torch.equal(w[:, g0 * 32 : g1 * 32].dequantize(), dense[:, g0 * 32 : g1 * 32])
    assert torch.equal(w[perm].dequantize(), dense[perm])
    assert torch.equal(torch.cat([w[a:b], w[:a], w]).dequantize(), torch.cat([dense[a:b], dense[:a], dense]))


def test_a_column_split_inside_a_group_is_refused():
    w = _random_int4(1, 2, 0)
    with pytest.raises(ValueError, match="groups"):
        w[:, 16:48]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), groups=st.integers(1, 4), seed=st.integers(0, 2**16), spread=st.floats(1e-3, 1e3))
def test_requantized_values_are_within_half_a_step(n, groups, seed, spread):
    values = torch.randn(n, groups * 32, generator=torch.Generator().manual_seed(seed)) * spread
    for fmt in quant.FORMATS:
        q = quant.as_format(values, fmt)
        assert q.format == fmt
        low, high = (0, 15) if fmt == "int4" else (-127, 127)
        assert int(q.codes.min()) >= low and int(q.codes.max()) <= high
        step = q.scale.repeat_interleave(q.group, 1)
        assert bool(((q.dequantize() - values).abs() <= step / 2 * (1 + 1e-5) + 1e-6 * spread).all()), fmt


@needs_kernels
@pytest.mark.parametrize("fmt,backend", [("int4", "int4pack"), ("int8", "int8pack")])
def test_packed_kernels_compute_their_dequantized_weights(fmt, backend):
    values = torch.randn(96, 192, generator=torch.Generator().manual_seed(3)) * 0.05
    q = quant.as_format(values, fmt)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = ops.Linear(q, ops.LinearPlan(backend, 1), torch.bfloat16)(x).float()
    want = x.float() @ q.dequantize().t()
    assert float((got - want).norm() / want.norm()) < 1e-2  # bf16 scales and output rounding only
    assert ops.Linear(q, ops.LinearPlan(backend, 1), torch.bfloat16).weight_bytes < 2 * values.numel()  # < bf16


class _SplitKWhenAlone(ops.Int4PackBackend):
    """An int4 kernel that sums a lone row's K in two halves: a reordering the probe must catch."""

    name = "split-k-int4"

    def prepare(self, weight, dtype):
        return super().prepare(weight, dtype), weight.dequantize()

    def run(self, prepared, x):
        packed, dense = prepared
        if x.shape[0] != 1:
            return super().run(packed, x)
        half = x.shape[1] // 2
        return (x[:, :half].float() @ dense[:, :half].t() + x[:, half:].float() @ dense[:, half:].t()).to(x.dtype)


@needs_kernels
def test_quantized_calibration_finds_plans_and_sees_reorderings(tmp_path, monkeypatch):
    planner = LinearPlanner(CPU, torch.bfloat16, tmp_path)
    for fmt in quant.FORMATS:
        plan = planner.plan((192, 576), fmt)
        assert ops.BACKENDS[plan.backend].weight_format == fmt
    assert LinearPlanner(CPU, torch.bfloat16, tmp_path).plan((192, 576), "int4") == planner.plan((192, 576), "int4")

    fake = _SplitKWhenAlone()
    monkeypatch.setitem(ops.BACKENDS, fake.name, fake)
    assert not plan_passes((64, 256), torch.bfloat16, CPU, ops.LinearPlan(fake.name, 1))
    assert plan_passes((64, 256), torch.bfloat16, CPU, ops.LinearPlan("int4pack", 1))


def test_quantization_resolves_per_checkpoint_dtype_and_request(smollm2):
    tiny = load_model("tiny")
    bf16, fp32 = torch.bfloat16, torch.float32
    assert resolve_quantization("none", smollm2, bf16, CPU) == "none"
    # aten's packed kernels are slow with fp32 activations; the native ones are not
    assert resolve_quantization("auto", smollm2, fp32, CPU) == (CHECKPOINT if NATIVE_KERNELS else "none")
    assert resolve_quantization("auto", tiny, bf16, CPU) == "none"  # nothing quantized in the checkpoint
    if BF16_KERNELS:
        assert resolve_quantization("auto", smollm2, bf16, CPU) == CHECKPOINT
        assert resolve_quantization("int8", tiny, bf16, CPU) == "int8"
    with pytest.raises(UserError, match="--quantization"):
        resolve_quantization("fp8", smollm2, bf16, CPU)
    identities = {with_weight_format(smollm2, r, CPU).identity for r in ("none", "int8", "int4", CHECKPOINT)}
    assert len(identities) == 4 and with_weight_format(smollm2, "none", CPU).identity == smollm2.identity
    # aten's packed kernels (where the native build failed) round otherwise: another identity, no shared KV
    with mock.patch.object(native, "library", return_value=None):
        without_native = with_weight_format(smollm2, "int8", CPU).identity
    assert (without_native != with_weight_format(smollm2, "int8", CPU).identity) == NATIVE_KERNELS


@pytest.mark.slow
@needs_kernels
def test_checkpoint_format_keeps_each_tensor_in_its_own(smollm2, tmp_path):
    factory = LinearFactory(CHECKPOINT, torch.bfloat16, CPU, LinearPlanner(CPU, torch.bfloat16, tmp_path))
    layer = factory(smollm2.quantized["model.layers.0.mlp.down_proj.weight"])
    head = factory(smollm2.quantized["model.embed_tokens.weight"])
    dense = factory(smollm2.weights["model.layers.0.mlp.down_proj.weight"])  # values without codes
    assert (layer.weight_format, head.weight_format, dense.weight_format) == ("int4", "int8", "dense")
    # 4-bit codes two to a byte plus a 2-byte scale and offset per 32 weights (0.625 bytes a weight): bf16
    # ones for aten's packed kernel, the GGUF's float16 ones for the native kernel
    assert layer.weight_bytes == 576 * 1536 * 5 // 8
