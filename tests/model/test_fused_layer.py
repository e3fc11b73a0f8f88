"""A decoder layer's head and tail as one native call each (hicache/model/kernels/fused_layer.py, csrc/layer.cpp):
they give the bits of the layer's Python path (the input RMSNorm, q/k/v, RoPE and the packed KV row; o_proj
and its residual, the post-attention RMSNorm, the SwiGLU MLP and its residual), at any row count, in both
activation dtypes and both quantized formats; and they exist only where every part runs natively (at TP 1).
The layers after the first as one call (LayerStack) give the forward pass's logits and pool bits."""

from __future__ import annotations

import pytest
import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.model.batch import ForwardBatch, SeqSlice
from hicache.model.build import build_decoder, with_attention_family, with_weight_format
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


@pytest.mark.slow
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


def _step(lengths: list[int], new: list[int], page: int) -> tuple[ForwardBatch, int]:
    """A step of sequences with `lengths` keys, the last `new[i]` of them this step's rows, each sequence's
    slots its own pages; and the pool's pages."""
    ids, positions, out_slots, seqs, first, start = [], [], [], [], 0, 0
    for length, rows in zip(lengths, new):
        slots = torch.arange(first, first + length)
        seqs.append(SeqSlice(start, rows, slots))
        positions += range(length - rows, length)
        out_slots += slots[length - rows :].tolist()
        ids += [(7 * length + i) % 200 + 5 for i in range(rows)]  # below tiny's vocabulary
        first += -(-length // page) * page
        start += rows
    ids_, positions_, out_ = (torch.tensor(x, dtype=torch.int64) for x in (ids, positions, out_slots))
    logits = torch.tensor([seq.start + seq.length - 1 for seq in seqs])
    return ForwardBatch(ids_, positions_, out_, seqs, logits), first // page


@pytest.mark.parametrize(("fmt", "dtype"), [("int4", torch.float32), ("int8", torch.bfloat16)], ids=str)
@pytest.mark.parametrize(("lengths", "new"), [([129, 40, 700], [1, 1, 1]), ([300, 77], [37, 77])], ids=str)
def test_the_layer_stack_is_the_forward_pass_bit_for_bit(fmt, dtype, lengths, new):
    """A decode batch and prefill chunks through the layers after the first in one call: the logits and every
    pool row of the Python layers (whose attention replays the plan's calls layer by layer)."""
    loaded = with_attention_family(with_weight_format(load_model("tiny"), fmt, CPU), CPU)
    model = build_decoder(loaded, ParallelContext(), dtype, CPU)
    assert model.layer_stack is not None and len(model.layers) > 1
    page = 16
    batch, pages = _step(lengths, new, page)
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, pages, page, dtype, CPU)
    gen = torch.Generator().manual_seed(1)
    before = [torch.randn(buffer.shape, generator=gen).to(dtype) for buffer in pool.buffers]
    results = []
    with torch.inference_mode():
        for stack in (model.layer_stack, None):
            model.layer_stack = stack
            for buffer, values in zip(pool.buffers, before):
                buffer.copy_(values)
            results.append((model.forward(batch, pool), [buffer.clone() for buffer in pool.buffers]))
    (logits, rows), (expected_logits, expected_rows) = results
    assert torch.equal(logits, expected_logits)
    assert all(torch.equal(a, b) for a, b in zip(rows, expected_rows))
    assert not all(torch.equal(a, b) for a, b in zip(rows, before))  # the step wrote its KV rows
