"""hicache's native weight-only quantized GEMMs (hicache/model/kernels/native.py, csrc/qgemm.cpp): their
activation quantization is bitwise the documented one and keeps 16 bits of a group, they compute the
dequantized weights' product with the quantized activations to float32 rounding, a row's bits never
depend on the call it is in (rows, position, thread count), they run on torch's threads, the calibration
picks them first, and plans measured without them are not reused."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.model.kernels import calibration, native, ops, quant, tp_groups

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.bfloat16)
pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels not built on this machine")


def _weight(fmt: str, n: int, k: int, seed: int) -> quant.QuantizedWeight:
    values = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quant.as_format(values, fmt)


def _linear(weight: quant.QuantizedWeight, dtype: torch.dtype) -> ops.Linear:
    return ops.Linear(weight, ops.LinearPlan(f"native-{weight.format}", 1), dtype)


def _dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: e Q per group (native.quantize_activations), in float64."""
    high, low, e, _ = native.quantize_activations(x.float())
    codes = (high.double() * 255 + low.double()).view(x.shape[0], -1, quant.INT4_GROUP)
    return (codes * e.double()[..., None]).view(x.shape)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 12), seed=st.integers(0, 2**16),
       magnitude=st.sampled_from([0.0, 1e-39, 1e-30, 1e-3, 1.0, 3e4]))  # fmt: skip
def test_the_activation_quantization_is_the_documented_one_and_keeps_16_bits(rows, groups, seed, magnitude):
    x = torch.randn(rows, 32 * groups, generator=torch.Generator().manual_seed(seed)) * magnitude
    x[0, :32] = 0  # an all-zero group
    kernel, documented = native.library().quantize_activations(x), native.quantize_activations(x)
    assert all(torch.equal(a, b) for a, b in zip(kernel, documented))
    high, low, e, s = documented
    assert int(high.abs().max()) <= 127 and int(low.abs().max()) <= 127
    largest = x.view(rows, groups, 32).abs().amax(-1, keepdim=True).double()
    error = (_dequantized_activations(x) - x.double()).view(rows, groups, 32).abs()
    normal = e[..., None] >= torch.finfo(torch.float32).tiny  # below: the group is taken as zero
    assert bool(torch.where(normal, error <= largest * (2.0**-16 + 2.0**-22), error <= largest).all())
    codes = (high.float() * 255 + low.float()).view(rows, groups, 32)
    assert torch.equal(s, e * codes.sum(-1))


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(quant.FORMATS), dtype=st.sampled_from(DTYPES), panels=st.integers(1, 40),
       groups=st.integers(1, 24), rows=st.integers(1, 40), seed=st.integers(0, 2**16))  # fmt: skip
def test_product_is_the_dequantized_operands_to_float32_rounding(fmt, dtype, panels, groups, rows, seed):
    weight = _weight(fmt, 8 * panels, 32 * groups, seed)
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    got = _linear(weight, dtype)(x)
    assert got.dtype == dtype and got.shape == (rows, weight.shape[0])
    dense, xq = weight.dequantize().double(), _dequantized_activations(x)
    exact = xq @ dense.t()
    # float32 steps a group over K: a few units of rounding of the sum of |products|, and the output
    # rounding of the activation dtype
    bound = (xq.abs() @ dense.abs().t()) * weight.shape[1] * 2.0**-24 + exact.abs() * torch.finfo(dtype).eps
    assert bool(((got.double() - exact).abs() <= bound).all())
    # and x itself to ~2^-16 of each group's largest input
    assert bool(((got.double() - x.double() @ dense.t()).abs() <= bound + (x.double().abs() @ dense.abs().t())
                 * 2.0**-14).all())  # fmt: skip


@settings(max_examples=12, deadline=None)
@given(fmt=st.sampled_from(quant.FORMATS), dtype=st.sampled_from(DTYPES), rows=st.integers(1, 37),
       offset=st.integers(0, 26), shape=st.sampled_from([(64, 576), (192, 576), (24, 1536)]))  # fmt: skip
def test_a_rows_bits_do_not_depend_on_its_call(fmt, dtype, rows, offset, shape):
    # Operands on which any change of a dot product's summation order shows (calibration's probe).
    weight, x = calibration.probe_quantized(*shape, 64, fmt, dtype, CPU)
    linear = _linear(weight, dtype)
    reference = linear(x[:64])
    assert torch.equal(linear(x[offset : offset + rows]), reference[offset : offset + rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x[offset : offset + rows]), reference[offset : offset + rows])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_the_probe_sees_another_summation_order(fmt):
    """Negative control for the test above: on its operands, the same dequantized operands summed in
    another order (a float32 matmul) give other bits, so equal bits there mean the same order."""
    weight, x = calibration.probe_quantized(192, 576, 64, fmt, torch.float32, CPU)
    native_bits = _linear(weight, torch.float32)(x)
    xq = _dequantized_activations(x).float()
    other_order = xq @ weight.dequantize().t()
    rounding = (xq.abs() @ weight.dequantize().abs().t()) * x.shape[1] * 2.0**-24  # the same sum, to rounding
    assert bool(((native_bits - other_order).abs() <= rounding).all())
    assert not torch.equal(native_bits, other_order)


@pytest.mark.parametrize("dtype", DTYPES)
def test_calibration_plans_quantized_weights_on_the_native_kernels_one_row_at_a_time(dtype, tmp_path):
    planner = calibration.LinearPlanner(CPU, dtype, tmp_path)
    for fmt in quant.FORMATS:
        assert planner.plan((192, 576), fmt) == ops.LinearPlan(f"native-{fmt}", 1)


def test_plans_measured_without_this_native_version_are_not_reused(monkeypatch):
    before = calibration.platform_fingerprint(CPU)
    monkeypatch.setattr(native, "VERSION", native.VERSION + 1)
    assert calibration.platform_fingerprint(CPU) != before


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernels_run_on_torchs_threads(threads):
    """The library's parallel regions use the threads torch is set to (a build without OpenMP ran every
    kernel on the calling thread alone, which no bitwise test could see), and a region of fewer units
    than threads takes only as many."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert native.library().parallel_threads(8) == threads
        assert native.library().parallel_threads(1) == 1
    finally:
        torch.set_num_threads(before)


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(quant.FORMATS), dtype=st.sampled_from(DTYPES), groups=st.integers(1, 5),
       rows=st.integers(0, 9), seed=st.integers(0, 2**16))  # fmt: skip
def test_a_linear_sum_is_the_calls_one_by_one_and_their_pairwise_sum(fmt, dtype, groups, rows, seed):
    """RowGroups' one call (ops.linear_sum): each group's product with its slice of x, rounded to x's dtype,
    then tp_groups.pairwise_sum in float32, bit for bit."""
    linears = [_linear(_weight(fmt, 24, 64, seed + g), dtype) for g in range(groups)]
    x = torch.randn(rows, 64 * groups, generator=torch.Generator().manual_seed(seed)).to(dtype)
    one_by_one = [lin(x[:, 64 * g : 64 * (g + 1)]).float() for g, lin in enumerate(linears)]
    summed = ops.linear_sum(linears)
    assert summed is not None
    got = summed(x)
    assert got.dtype == torch.float32 and torch.equal(got, tp_groups.pairwise_sum(one_by_one))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_float16_int4_scales_are_the_float32_ones_at_fewer_bytes(rows, groups, seed):
    """A weight whose scales and offsets are all float16 values (a GGUF Q4_1's) gets float16 operands, 5/6
    of the bytes, and the float32 operands' bits, alone and summed; any other keeps float32."""
    w = _weight("int4", 24, 64, seed)
    gguf_like = dataclasses.replace(w, scale=w.scale.half().float(), offset=w.offset.half().float())
    codes, scale, offset = native.int4_operands(gguf_like)
    assert scale.dtype == offset.dtype == torch.float16
    assert native.int4_operands(_weight("int4", 24, 64, seed))[1].dtype == torch.float32  # float32 scales
    wide = (codes, scale.float(), offset.float())
    assert codes.numel() + 2 * scale.numel() * scale.element_size() == 5 * sum(t.nbytes for t in wide) // 6
    x = torch.randn(rows, 64 * groups, generator=torch.Generator().manual_seed(seed))
    lib = native.library()
    assert torch.equal(lib.int4_linear(x[:, :64], codes, scale, offset), lib.int4_linear(x[:, :64], *wide))
    assert torch.equal(lib.int4_linear_sum(x, [codes] * groups, [scale] * groups, [offset] * groups),
                       lib.int4_linear_sum(x, [codes] * groups, [wide[1]] * groups, [wide[2]] * groups))  # fmt: skip


@pytest.mark.slow
def test_a_build_killed_midway_does_not_hold_up_the_next_start():
    """torch's build lock outlives a build killed midway (a server stopped during its first start), and
    every later start waited on it forever; the next build now finds it left over and goes on."""
    pytest.importorskip("ninja")
    if native.library() is None:
        pytest.skip("no native build on this machine")
    leftover = native.build_dir() / "lock"
    leftover.touch()
    done = subprocess.run([sys.executable, "-c", "from hicache.model.kernels import native; native.build()"],
                          timeout=300, capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert not leftover.exists()


_PRODUCTS_SCRIPT = """
import sys, torch
from hicache.model.kernels import native, quant
lib, out = native.library(), {"isa": native.library().kernel_isa()}
for n, k, m in [(8, 32, 1), (24, 64, 2), (64, 576, 3), (192, 576, 4), (1536, 576, 9), (576, 1536, 37)]:
    g = torch.Generator().manual_seed(n * k + m)
    x = torch.randn(m, k, generator=g)
    int4 = native.int4_operands(quant.as_format(torch.randn(n, k, generator=g) * 0.05, "int4"))
    half = (int4[0], int4[1].half(), int4[2].half())
    int8 = native.int8_operands(quant.as_format(torch.randn(n, k, generator=g) * 0.05, "int8"))
    out[n, k, m] = (lib.int4_linear(x, *int4), lib.int4_linear(x, *half), lib.int8_linear(x, *int8),
                    lib.int4_linear_sum(torch.cat([x, x], 1), *[[t, t] for t in half]),
                    lib.int8_linear_sum(torch.cat([x, x], 1), *[[t, t] for t in int8]))
torch.save(out, sys.argv[1])
"""


def test_every_isa_path_computes_the_same_bits(tmp_path):
    """The AVX-512 VNNI passes (where the CPU has them) sum the same exact integers as the AVX2 ones, so a
    product's bits do not depend on which ran: the same calls in a process left to pick and in one that
    ATEN_CPU_CAPABILITY=avx2 forces to the AVX2 passes give the same bits. On an AVX2-only CPU both
    processes run AVX2."""
    vnni_flags = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    products = []
    for expected, forced in [("avx512-vnni" if vnni_flags <= native._cpu_flags() else "avx2", None), ("avx2", "avx2")]:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if forced:
            env["ATEN_CPU_CAPABILITY"] = forced
        path = tmp_path / f"{forced}.pt"
        subprocess.run([sys.executable, "-c", _PRODUCTS_SCRIPT, str(path)], env=env, check=True, timeout=300)
        products.append(torch.load(path))
        assert products[-1].pop("isa") == expected
    ours, theirs = products
    assert ours.keys() == theirs.keys()
    for shape, calls in ours.items():
        assert all(torch.equal(a, b) for a, b in zip(calls, theirs[shape], strict=True)), shape
