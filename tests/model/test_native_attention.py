"""The native key-block attention kernel (csrc/attention.cpp through native_attention.py): a row's bits
are its own whatever shares the call (rows, entries, padding, threads), reading the pool in place gives
the bits of a gathered copy, the result is attention (against float64), and a server attending with it
has another identity than one attending with aten's kernel (their bits differ)."""

from __future__ import annotations

import pytest
import torch

from hicache.model.build import with_attention_family
from hicache.model.kernels import key_block_attention, key_blocks, native, native_attention, ops
from hicache.model.loading.loader import load_model

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels not built on this machine")

CPU = torch.device("cpu")
# (query heads, KV heads, key width, value width): tiny, tiny-mla (a head per latent head), smollm2, and
# values narrower than keys.
WIDTHS = [(4, 2, 32, 32), (4, 4, 32, 32), (9, 3, 64, 64), (4, 2, 48, 32)]
DTYPES = [torch.float32, torch.bfloat16]
# Keys a row sees in its block: around the 64-key tile and the 8-key score group, and a whole block.
SEEN = (1, 7, 8, 9, 63, 64, 65, 127, 128, 1000, 2047, 2048)
BLOCK = 2048


def _operands(widths, dtype, slots, seed=0):
    _, Hkv, d, dv = widths
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(slots, Hkv * (d + dv), generator=gen).to(dtype)  # packed rows, as the pool holds them
    k, v = pool[:, : Hkv * d].view(slots, Hkv, d), pool[:, Hkv * d :].view(slots, Hkv, dv)
    return k, v, gen


def _call(q, k, v, index, seen, live):
    return native.library().block_attend(q, k, v, [index], seen, live, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("widths", WIDTHS, ids=str)
def test_a_rows_bits_are_its_own_in_any_call(widths, dtype):
    """Three entries over shuffled pool slots, rows seeing every length of SEEN (padding rows beyond an
    entry's live ones), against each row alone in its own call, and at one thread."""
    H, d = widths[0], widths[2]
    k, v, gen = _operands(widths, dtype, 3 * BLOCK + 5)
    index = torch.randperm(3 * BLOCK + 5, generator=gen)[: 3 * BLOCK].view(3, BLOCK)
    n = len(SEEN)
    q = torch.randn(3, n, H, d, generator=gen).to(dtype)
    seen = torch.tensor(SEEN).repeat(3, 1)
    live = torch.tensor([n, n - 2, 5])
    out, lse = _call(q, k, v, index, seen, live)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_out, one_lse = _call(q, k, v, index, seen, live)
    finally:
        torch.set_num_threads(threads)
    for e in range(3):
        for i in range(int(live[e])):
            alone_out, alone_lse = _call(q[e : e + 1, i : i + 1].contiguous(), k, v, index[e : e + 1],
                                         seen[e : e + 1, i : i + 1].contiguous(), torch.tensor([1]))  # fmt: skip
            assert torch.equal(out[e, i], alone_out[0, 0]) and torch.equal(lse[e, i], alone_lse[0, 0]), (e, i)
            assert torch.equal(out[e, i], one_out[e, i]) and torch.equal(lse[e, i], one_lse[e, i]), (e, i)
    # A row seeing the whole block is the same row in an unmasked call (seen empty: all keys).
    whole_out, whole_lse = _call(q[:1, -1:].contiguous(), k, v, index[:1], torch.empty(0, dtype=torch.int64),
                                 torch.tensor([1]))  # fmt: skip
    assert torch.equal(whole_out[0, 0], out[0, -1]) and torch.equal(whole_lse[0, 0], lse[0, -1])


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=str)
@pytest.mark.parametrize("widths", WIDTHS, ids=str)
def test_the_kernel_is_attention(widths, dtype, tolerance):
    """Output and log-sum-exp against a float64 softmax over each row's visible keys."""
    H, Hkv, d, _ = widths
    k, v, gen = _operands(widths, dtype, BLOCK)
    index = torch.arange(BLOCK).view(1, BLOCK)
    q = torch.randn(1, len(SEEN), H, d, generator=gen).to(dtype)
    seen = torch.tensor([SEEN])
    out, lse = _call(q, k, v, index, seen, torch.tensor([len(SEEN)]))
    kd, vd = (t.double().repeat_interleave(H // Hkv, 1) for t in (k, v))
    scores = torch.einsum("rhd,lhd->rhl", q[0].double(), kd) * d**-0.5
    scores = scores.masked_fill((torch.arange(BLOCK) >= seen[0].unsqueeze(1))[:, None], float("-inf"))
    want = torch.einsum("rhl,lhd->rhd", scores.softmax(-1), vd)
    assert float((out[0].double() - want).abs().max()) < tolerance
    assert float((lse[0].double() - scores.logsumexp(-1)).abs().max()) < 1e-5



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_native_combine_is_each_rows_own_and_the_combine(dtype):
    """combine_blocks folds 5 blocks of 6 rows: in one call, block by block, and each row alone through
    `dest` (rows in another order) give the same bits; the result is the float64 combine of the blocks
    (softmax weights e^lse) to float32 rounding."""
    B, m, H, dv = 5, 6, 4, 32
    gen = torch.Generator().manual_seed(3)
    outs = torch.randn(B, m, H, dv, generator=gen).to(dtype)
    lses = torch.randn(B, m, H, generator=gen) * 4

    def state(rows):
        return (torch.full((rows, H), float("-inf")), torch.zeros(rows, H), torch.zeros(rows, H, dv))

    whole = state(m)
    native_attention.combine(*whole, torch.empty(0, dtype=torch.int64), outs, lses)
    stepwise = state(m)
    for b in range(B):
        native_attention.combine(*stepwise, torch.empty(0, dtype=torch.int64), outs[b : b + 1], lses[b : b + 1])
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    alone = state(m + 2)  # two more rows that no call names stay untouched
    for i in range(m):
        native_attention.combine(*alone, order[i : i + 1], outs[:, i : i + 1], lses[:, i : i + 1])
    for mine, step, single, untouched in zip(whole, stepwise, alone, state(2)):
        assert torch.equal(mine, step) and torch.equal(mine, single[order]) and torch.equal(single[m:], untouched)
    top, total, acc = whole
    weights = (lses.double() - lses.double().amax(0)).exp()
    want = (outs.double() * weights.unsqueeze(-1)).sum(0) / weights.sum(0).unsqueeze(-1)
    assert torch.equal(top, lses.amax(0))
    assert float(((acc / total.unsqueeze(-1)).double() - want).abs().max()) < 1e-5

# (the rows each sequence's queries see): one sequence's rows at 1 to 3 blocks; a decode batch whose
# sequences share whole blocks, up to 11 of them, so that one kernel call takes a call's repeats over 8
# blocks, then the rest, and a sequence that stops seeing whole blocks ends a run of them.
IN_PLACE_CASES = {"rows of one sequence": ((1, 300, 512, 513, 1100, 3 * 512 + 77),),
                  "a decode batch": ((11 * 512 + 5,), (9 * 512,), (700,), (8 * 512 + 1,))}  # fmt: skip


@pytest.mark.parametrize("case", IN_PLACE_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reading_the_pool_in_place_gives_the_gathered_bits(dtype, case):
    """block_attention over a plan whose reads name pool slots (the local backend's in-place reads, whose
    repeats over consecutive blocks run as one kernel call) equals the same plan over gathered copies of
    those rows (a kernel call per read), bit for bit."""
    H, _, d, _ = WIDTHS[0]
    sequences = IN_PLACE_CASES[case]
    slots = max(seen[-1] for seen in sequences)
    k, v, gen = _operands(WIDTHS[0], dtype, slots)
    # Each sequence's keys at random slots; slot 0 stands past a sequence's end, as the backend's reads
    # have it (masked).
    orders = [torch.cat([torch.randperm(slots, generator=gen), torch.zeros(512, dtype=torch.int64)])
              for _ in sequences]  # fmt: skip
    queries, start = [], 0
    for i, seen in enumerate(sequences):
        queries.append(key_blocks.QueryRows(i, start, seen))
        start += len(seen)
    plan = key_blocks.plan(queries, start, CPU, 512)
    q = torch.randn(start, H, d, generator=gen).to(dtype)

    def rows_of(i):
        n = plan.reads[i].length
        return torch.cat([orders[seq][first : first + n] for seq, first in plan.reads[i].entries])

    in_place = ops.block_attention(q, plan, lambda i: (k, v, rows_of(i)), d**-0.5)
    gathered = ops.block_attention(q, plan, lambda i: (k[rows_of(i)], v[rows_of(i)]), d**-0.5)
    assert torch.equal(in_place, gathered)


# Plans the native replay takes: a one-block plan (a decode step's: its result is the block's output,
# rows picked from padded calls) and ones combining blocks, in order and by row (IN_PLACE_CASES).
REPLAY_CASES = {"a decode step": ((129,), (40,), (300,)), "prefill rows": ((1, 2, 3, 200, 511),),
                **IN_PLACE_CASES}  # fmt: skip


@pytest.mark.parametrize("case", REPLAY_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_native_replay_is_the_layer_the_plan_would_run(dtype, case):
    """A forward pass's second layer through `Replay` (one native call: the KV write and the recorded
    calls) writes the pool rows index_copy_ writes and attends with the bits of the same plan run afresh
    and of its Python replay."""
    H, Hkv, d, dv = WIDTHS[2]
    sequences = REPLAY_CASES[case]
    slots = max(seen[-1] for seen in sequences) + 8
    gen = torch.Generator().manual_seed(7)
    queries, start, slot_of = [], 0, []
    for i, seen in enumerate(sequences):
        queries.append(key_blocks.QueryRows(i, start, seen))
        start += len(seen)
        slot_of.append(torch.cat([torch.randperm(slots, generator=gen), torch.zeros(512, dtype=torch.int64)]))
    plan = key_blocks.plan(queries, start, CPU, 512)
    reads = [torch.cat([slot_of[seq][first : first + plan.reads[i].length] for seq, first in plan.reads[i].entries])
             for i in range(len(plan.reads))]  # fmt: skip
    layers = [torch.randn(slots, Hkv * (d + dv), generator=gen).to(dtype) for _ in range(2)]

    def views(pool):
        return pool[:, : Hkv * d].view(slots, Hkv, d), pool[:, Hkv * d :].view(slots, Hkv, dv)

    def attend(pool, q):  # the plan's reads give the same slot tensors layer after layer, as the backend's do
        k, v = views(pool)
        return ops.block_attention(q, plan, lambda i: (k, v, reads[i]), d**-0.5)

    q0, q1 = (torch.randn(start, H, d, generator=gen).to(dtype) for _ in range(2))
    attend(layers[0], q0)  # the first layer records its calls
    assert plan.native_calls is not None
    replay = native_attention.Replay(plan)
    where = torch.randperm(slots, generator=gen)[:3]
    kv = torch.randn(3, Hkv * (d + dv), generator=gen)  # float32: written in the pool's dtype
    written = layers[1].clone()
    replayed = replay(q1, kv, written, where, *views(written), d**-0.5)
    layers[1].index_copy_(0, where, kv.to(dtype))
    assert torch.equal(written, layers[1])
    python_replay = attend(layers[1], q1)
    plan.native_calls = None
    assert torch.equal(replayed, python_replay) and torch.equal(replayed, attend(layers[1], q1))


def test_native_and_aten_attention_differ_so_identities_do():
    """The negative control of the identity: the two kernel families give other bits for the same rows,
    hence a model's identity on a CPU with the native build names it (and on another device not)."""
    H, _, d, _ = WIDTHS[0]
    k, v, gen = _operands(WIDTHS[0], torch.float32, 512)
    q = torch.randn(1, 8, H, d, generator=gen)
    native_out, _ = _call(q, k, v, torch.arange(512).view(1, 512), torch.empty(0, dtype=torch.int64),
                          torch.tensor([8]))  # fmt: skip
    keys, values = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
    aten_out, _ = key_block_attention._block_kernel(q.transpose(1, 2), keys, values, None, d**-0.5)
    assert not torch.equal(native_out, aten_out.transpose(1, 2))
    assert torch.allclose(native_out, aten_out.transpose(1, 2), atol=1e-5)
    tiny = load_model("tiny")
    family = f"native-attention-v{native.ATTENTION_VERSION}-rows-v{native.ROW_OPS_VERSION}"
    assert native_attention.attention_family(CPU) == family
    assert with_attention_family(tiny, CPU).identity != tiny.identity
    assert with_attention_family(tiny, torch.device("meta")).identity == tiny.identity


@pytest.mark.parametrize("widths", WIDTHS[2:], ids=str)  # smollm2's, and values narrower than keys
def test_a_bf16_pool_under_float32_queries_is_the_float32_kernel_on_its_widened_rows(widths):
    """--kv-cache-dtype bfloat16 under float32 activations: the kernel widens the pool's bf16 keys and
    values as it loads them, so its result is, bit for bit, the float32 kernel's on those rows widened
    (exact) beforehand, for decode rows and a prefill unit's shared tiles alike."""
    H, d = widths[0], widths[2]
    k, v, gen = _operands(widths, torch.bfloat16, 3 * BLOCK + 5)
    index = torch.randperm(3 * BLOCK + 5, generator=gen)[: 3 * BLOCK].view(3, BLOCK)
    n = len(SEEN)
    q = torch.randn(3, n, H, d, generator=gen)
    seen, live = torch.tensor(SEEN).repeat(3, 1), torch.tensor([n, n - 2, 5])
    mixed = _call(q, k, v, index, seen, live)
    widened = _call(q, k.float(), v.float(), index, seen, live)
    assert mixed[0].dtype == torch.float32 and native_attention.takes(q, k, v)
    for e, rows in enumerate(live.tolist()):  # rows past an entry's live ones are left unwritten
        assert torch.equal(mixed[0][e, :rows], widened[0][e, :rows])
        assert torch.equal(mixed[1][e, :rows], widened[1][e, :rows])
    assert not native_attention.takes(q.bfloat16(), k.float(), v.float())  # float32 KV under bf16 queries: no
