"""Attention over KV in fixed blocks of keys (hicache/model/kernels/key_blocks.py, ops.block_attention):
a row's bits do not depend on what shares its call at any block count or remainder, the blocked result
is attention (against float64), and a step's memory does not grow with the context."""

from __future__ import annotations

import pytest
import torch

from hicache.model.kernels import key_block_attention, key_blocks, ops
from hicache.model.kernels.invariance import block_attention_probe

CPU = torch.device("cpu")
BLOCK = 1024  # small, so 17 blocks are 17K keys; two KV_ALIGN units, so a last block has two lengths
REMAINDERS = (0, 1, 511, 512, 513, BLOCK - 1)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_block_count_and_remainder_gives_the_rows_alone(dtype):
    """k * BLOCK + r keys for k = 0..16 and r in every remainder class: each sequence's last 4 rows as
    one prefill step with every other sequence's, each row alone, the last rows as one decode step."""
    lengths = tuple(k * BLOCK + r for k in range(17) for r in REMAINDERS if k * BLOCK + r > 0)
    assert block_attention_probe(lengths, BLOCK, dtype, CPU, chunk=4) == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunks_across_query_pieces_and_blocks_give_the_rows_alone(dtype):
    """Chunks longer than a query piece (Q_PIECE rows) whose rows cross block boundaries, with GQA
    heads of another shape, at the smallest block."""
    lengths = (520, 2 * 512 + 5)
    assert block_attention_probe(lengths, key_blocks.KV_ALIGN, dtype, CPU, heads=(6, 2, 64), chunk=520) == []


def _attend(q, k, v, seen, block):
    """Rows q [R, H, d] of one sequence with keys k, v [L, Hkv, d], row i seeing seen[i] keys."""
    plan = key_blocks.plan([key_blocks.QueryRows(0, 0, tuple(seen))], q.shape[0], CPU, block)

    def read(i):
        r = plan.reads[i]
        (_, first), n = r.entries[0], r.length
        pad = max(0, first + n - k.shape[0])
        return tuple(torch.cat([t[first : first + n], t.new_zeros(pad, *t.shape[1:])]) for t in (k, v))

    return ops.block_attention(q, plan, read, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=str)
@pytest.mark.parametrize("block", [512, 1024, key_blocks.KV_BLOCK])
def test_blocked_attention_is_attention(dtype, tolerance, block):
    """Against a float64 softmax over every visible key, for rows spread over 1 to 9 blocks."""
    gen = torch.Generator().manual_seed(block)
    L, H, Hkv, d = 9 * 512 + 77, 4, 2, 32
    k, v = (torch.randn(L, Hkv, d, generator=gen) for _ in range(2))
    seen = sorted({1, 2, 511, 512, 513, 1025, 2047, 3000, 4096, 4097, L - 1, L})
    q = torch.randn(len(seen), H, d, generator=gen)
    got = _attend(q.to(dtype), k.to(dtype), v.to(dtype), seen, block).double()
    kd, vd = (t.to(dtype).double().repeat_interleave(H // Hkv, 1) for t in (k, v))
    scores = torch.einsum("rhd,lhd->rhl", q.to(dtype).double(), kd) * d**-0.5
    visible = torch.arange(L) < torch.tensor(seen).unsqueeze(1)
    want = torch.einsum("rhl,lhd->rhd", scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1), vd)
    assert float((got - want).abs().max()) < tolerance


def test_math_block_is_the_cpu_kernel():
    """The path for devices without a kernel returning a log-sum-exp computes what the CPU kernel does
    (values narrower than keys, as MLA's)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 8, 32, generator=gen), torch.randn(3, 2, 512, 32, generator=gen)
    v = torch.randn(3, 2, 512, 16, generator=gen)
    hidden = torch.arange(512) >= torch.tensor([1, 300, 512]).view(3, 1, 1, 1)
    mask = torch.zeros(3, 1, 8, 512).masked_fill_(hidden, float("-inf"))
    for m in (None, mask):
        out, lse = ops.math_block(q, k, v, m, 0.2)
        ref_out, ref_lse = key_block_attention._block_kernel(q, k, v, m, 0.2)
        assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)


def _peak_bytes(context: int, rows: int) -> int:
    """Peak bytes allocated (less freed) while one decode step of `rows` sequences of `context` keys
    attends, the keys themselves held outside (as a pool holds them)."""
    H, Hkv, d, block = 4, 2, 32, 1024
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(context, Hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(rows, H, d, generator=gen)
    queries = [key_blocks.QueryRows(s, s, (context - s,)) for s in range(rows)]
    plan = key_blocks.plan(queries, rows, CPU, block)

    def read(i):
        r = plan.reads[i]
        index = torch.cat([torch.arange(f, f + r.length).clamp(max=context - 1) for _, f in r.entries])
        return k.index_select(0, index), v.index_select(0, index)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        ops.block_attention(q, plan, read, d**-0.5)
    # Every allocation and free, in time order (the op-level events only attribute allocations).
    memory = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events = sorted(memory, key=lambda e: e.start_ns())
    peak = held = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def test_a_steps_memory_does_not_grow_with_the_context():
    """Two blocks against 64: the peak is a block's keys per sequence plus per-row state, whatever the
    context (the whole KV would be 32x more at 64K keys)."""
    short, long = _peak_bytes(2 * 1024, 8), _peak_bytes(64 * 1024, 8)
    assert short > 0 and long <= 1.1 * short, (short, long)
