"""The native per-row ops (csrc/rowops.cpp through ops.rms_norm, ops.silu_mul, ops.rotate): RoPE is bit for
bit the torch expression it replaces; RMSNorm and SiLU times up are their own arithmetic, close to torch's,
a row's bits its own whatever shares the call (rows, threads); and a server computing with them has another
identity than one computing with torch's ops (their bits differ)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.model.build import with_attention_family
from hicache.model.kernels import native, ops
from hicache.model.loading.loader import load_model

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels not built on this machine")

DTYPES = (torch.float32, torch.bfloat16)


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rows_alone_and_one_thread(op, x: torch.Tensor) -> None:
    """A row's bits are the same in the whole call, alone, and at one thread."""
    whole = op(x)
    assert torch.equal(torch.cat([op(x[i : i + 1]) for i in range(x.shape[0])]), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(x), whole)
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from(DTYPES), tokens=st.integers(1, 9), heads=st.integers(1, 5),
       dim=st.sampled_from([16, 32, 64, 128]), seed=st.integers(0, 2**16))  # fmt: skip
def test_rope_is_the_torch_expression_bit_for_bit(dtype, tokens, heads, dim, seed):
    x = _randn(tokens, heads, dim, seed=seed, dtype=dtype)
    cos, sin = _randn(tokens, 1, dim, seed=seed + 1, dtype=dtype), _randn(tokens, 1, dim, seed=seed + 2, dtype=dtype)
    half = dim // 2
    expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    assert torch.equal(ops.rotate(x, cos, sin), expected)


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40), width=st.sampled_from([8, 64, 576, 960]),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 300.0]))  # fmt: skip
def test_rms_norm_is_each_rows_own_and_close_to_torchs(dtype, rows, width, seed, scale):
    x, weight = _randn(rows, width, seed=seed, dtype=dtype, scale=scale), _randn(width, seed=seed + 1, dtype=dtype)
    got = ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    _rows_alone_and_one_thread(lambda rows_: ops.rms_norm(rows_, weight, 1e-5), x)
    expected = _torch_rms_norm(x, weight, 1e-5).float()
    # float32: the row's scale to a few roundings; bf16: one bf16 step of either rounding
    tolerance = 1e-6 if dtype == torch.float32 else 2.0**-7
    assert bool(((got.float() - expected).abs() <= tolerance * (expected.abs() + weight.float().abs())).all())


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 20), groups=st.integers(1, 3),
       columns=st.sampled_from([8, 64, 512]), seed=st.integers(0, 2**16))  # fmt: skip
def test_silu_mul_is_each_rows_own_and_close_to_torchs(dtype, rows, groups, columns, seed):
    gate_up = _randn(rows, groups, 2 * columns, seed=seed, dtype=dtype, scale=4.0)
    got = ops.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (rows, groups * columns)
    _rows_alone_and_one_thread(ops.silu_mul, gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).reshape(rows, -1)
    tolerance = 1e-6 if dtype == torch.float32 else 2.0**-7
    assert bool(((got.float() - expected).abs() <= tolerance * expected.abs() + 1e-30).all())


def test_the_native_row_ops_round_otherwise_than_torch_so_identities_differ():
    """The negative control of the identity: RMSNorm's native bits differ from torch's on some rows, so a
    model's identity names the row ops' version, and aten's family (no native build) keeps the file's."""
    x, weight = _randn(64, 576, seed=0, dtype=torch.float32), _randn(576, seed=1, dtype=torch.float32)
    assert not torch.equal(ops.rms_norm(x, weight, 1e-5), _torch_rms_norm(x, weight, 1e-5))
    tiny = load_model("tiny")
    native_identity = with_attention_family(tiny, torch.device("cpu")).identity
    with mock.patch.object(native, "ROW_OPS_VERSION", native.ROW_OPS_VERSION + 1):
        assert with_attention_family(tiny, torch.device("cpu")).identity != native_identity
    with mock.patch.object(native, "library", return_value=None):
        ops.native_rows_for.cache_clear()
        try:
            assert torch.equal(ops.rms_norm(x, weight, 1e-5), _torch_rms_norm(x, weight, 1e-5))
            assert with_attention_family(tiny, torch.device("cpu")).identity == tiny.identity
        finally:
            ops.native_rows_for.cache_clear()
