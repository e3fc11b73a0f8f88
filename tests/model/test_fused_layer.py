"""A decoder layer's head and tail as one native call each (hicache/model/kernels/fused_layer.py, csrc/layer.cpp):
they give the bits of the layer's Python path (the input RMSNorm, q/k/v, RoPE and the packed KV row; o_proj
and its residual, the post-attention RMSNorm, the SwiGLU MLP and its residual), at any row count, in both
activation dtypes and both quantized formats; and they exist only where every part runs natively (at TP 1)."""

from __future__ import annotations

import pytest
import torch

from hicache.model.build import build_decoder, with_weight_format
from hicache.model.kernels import native, ops
from hicache.model.loading.loader import load_model
from hicache.parallel.parallel import ParallelContext

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels not built on this machine")

CPU = torch.device("cpu")


def _python_tail(layer, hidden: torch.Tensor, attn: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaModel._layer's lines after attention, as they run without the tail."""
    hidden = hidden + layer.o_proj(attn)
    x = ops.rms_norm(hidden, layer.post_norm, eps)
    return hidden + layer.down_proj(ops.silu_mul(layer.gate_up(x)))


@pytest.mark.parametrize(("name", "fmt", "dtype"), [("tiny", "int4", torch.float32), ("tiny", "int8", torch.bfloat16),
                                                    ("smollm2", "checkpoint", torch.float32)])  # fmt: skip
def test_the_head_and_tail_are_the_layers_python_path_bit_for_bit(name, fmt, dtype):
    loaded = load_model(name)
    model = build_decoder(with_weight_format(loaded, fmt, CPU), ParallelContext(), dtype, CPU)
    eps = model.cfg.rms_norm_eps
    assert all(layer.head is not None and layer.tail is not None for layer in model.layers)
    gen = torch.Generator().manual_seed(0)
    width = model.layers[0].o_proj.groups[0].in_features * len(model.layers[0].o_proj.groups)
    with torch.inference_mode():
        for rows in (1, 3, 8, 37):
            hidden = torch.randn(rows, model.cfg.hidden_size, generator=gen).to(dtype)
            attn = torch.randn(rows, width, generator=gen).to(dtype)
            for layer in (model.layers[0], model.layers[-1]):
                got = layer.tail(hidden, attn)
                assert got.dtype == dtype and torch.equal(got, _python_tail(layer, hidden, attn, eps))
                positions = torch.randint(0, 4096, (rows,), generator=gen)
                q, kv = layer.head(hidden, *model.rope.tables(positions, dtype))
                expected_q, k, v = model._qkv(layer, ops.rms_norm(hidden, layer.input_norm, eps), positions)
                assert torch.equal(q, expected_q)
                assert torch.equal(kv, model.attention_layout.pack({"k": k, "v": v}))
                strided = torch.stack([hidden, hidden], -1)[..., 0]  # the same rows, not contiguous
                assert all(torch.equal(a, b) for a, b in zip(layer.head(strided, *model.rope.tables(positions, dtype)),
                                                             (q, kv)))  # fmt: skip


def test_no_tail_where_a_part_is_not_native():
    """Dense weights run on oneDNN or aten: the layer keeps its Python path."""
    model = build_decoder(load_model("tiny"), ParallelContext(), torch.float32, CPU)
    assert all(layer.head is None and layer.tail is None for layer in model.layers)
