"""The start-up self-check of the cache invariant, and the probe it shares with the tests.

A cache hit replaces a prefill of the cached tokens by their stored KV, so the tokens after it are
computed in calls of other shapes than in the cache-off run: a decode step instead of a row of a
prefill chunk, a chunk of another size, a batch with other requests. The probe feeds one random
sequence through this rank's first layer of each distinct kind (probe_layers.py: every other layer makes
the same kernel calls), its final norm and head, whole, in chunks of 1 to 10 rows (every remainder a 4- or
8-row kernel can leave), and with its last tokens as decode steps batched with another sequence,
and compares the outputs bit for bit. The probe's sequence fits one key block, so blocked attention is
also probed on its own over 1 to 5 blocks of the smallest size (`block_attention_probe`). It runs in
well under a second for the embedded models.

With several ranks every rank probes its own shard at once (the TP sums are collectives); a later
pipeline stage feeds random hidden states instead of token ids.

Every TP size runs the same GEMM calls and sums (tp_groups.py); what differs between topologies is the
threads a rank's kernels run on (the machine's CPUs shared among its ranks). So the whole sequence is
also fed at one thread: a rank whose kernels round alike at its thread count and at one computes what
a rank of any other TP size computes. Every rank runs it, whatever its count: the sums inside are
collectives every TP rank must enter. A difference there does not refuse the cache (it is exact at
this topology); it keeps the rank's stored pages apart from other thread counts'
(hicache/engine/build.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.model.base import DecoderModel
from hicache.model.batch import ForwardBatch, SeqSlice
from hicache.model.kernels import key_blocks, ops
from hicache.model.kernels.probe_layers import over_layers, representative_layers

logger = logging.getLogger(__name__)

PROBE_LEN = 48
PROBE_CHUNKS = (1, 2, 3, 5, 6, 7, 9, 10, 4, 1)  # sums to PROBE_LEN
REGION = 64  # slots per probe sequence: the whole run, the chunked run, the sequence sharing steps
# The model probe's sequences fit one key block; blocked attention is probed on its own at the smallest
# block, over 1 to 5 blocks and the remainders 1, 511, 0 and 300 (a row's last block: 1 key, a whole
# KV_ALIGN less one, exactly full, and a part of a second KV_ALIGN).
PROBE_BLOCK = key_blocks.KV_ALIGN
PROBE_BLOCK_LENGTHS = (1, 511, 512, 1025, 2048 + 300, 4 * 512 + 512)


@dataclass(frozen=True)
class InvarianceReport:
    verified: bool
    mechanisms: dict[str, str] = field(default_factory=dict)
    detail: str = ""  # what differed, when something did
    seconds: float = 0.0
    # The whole probe gave the same bits at one thread: any TP size, any thread count computes these.
    thread_count_invariant: bool = True

    def to_json(self) -> dict:
        return {"verified": self.verified, "mechanisms": self.mechanisms, "detail": self.detail,
                "thread_count_invariant": self.thread_count_invariant}  # fmt: skip


def feed(
    model: DecoderModel,
    pool: DeviceKVPool,
    inputs: torch.Tensor,
    cuts: list[int],
    base_slot: int,
    extra: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Feeds one sequence in chunks ending at `cuts`, its KV at slots base_slot.., and returns the
    output of every token, stacked: logits on the last stage, hidden states before it. `inputs` are
    token ids [L] (first stage) or hidden states [L, hidden]. `extra` = (inputs, base slot) of
    another sequence that shares every step, from position 0 (one token: a decode step)."""
    first_stage = inputs.dim() == 1
    device = model.device
    out, start = [], 0
    for end in cuts:
        n = end - start
        parts = [inputs[start:end]]
        positions = list(range(start, end))
        out_slots = list(range(base_slot + start, base_slot + end))
        seqs = [SeqSlice(0, n, torch.arange(base_slot, base_slot + end, device=device))]
        if extra is not None:
            e_inputs, e_base = extra
            e_len = e_inputs.shape[0]
            seqs.append(SeqSlice(n, e_len, torch.arange(e_base, e_base + e_len, device=device)))
            parts.append(e_inputs)
            positions += list(range(e_len))
            out_slots += list(range(e_base, e_base + e_len))
        rows = torch.cat(parts)
        batch = ForwardBatch(
            input_ids=rows if first_stage else torch.zeros(rows.shape[0], dtype=torch.int64, device=device),
            positions=torch.tensor(positions, device=device),
            out_slots=torch.tensor(out_slots, device=device),
            seqs=seqs,
            logit_rows=torch.arange(n, device=device),
        )
        result = model.forward(batch, pool, None if first_stage else rows)
        out.append(result[:n])
        start = end
    return torch.cat(out)


def probe_inputs(model: DecoderModel, length: int, seed: int) -> torch.Tensor:
    """Random token ids for the first stage, random hidden states for later ones (same on every
    rank of a TP group: the seed is shared)."""
    gen = torch.Generator().manual_seed(seed)
    if model.layer_range[0] == 0:
        return torch.randint(0, model.cfg.vocab_size, (length,), generator=gen).to(model.device)
    return torch.randn(length, model.cfg.hidden_size, generator=gen).to(device=model.device, dtype=model.dtype)


def mechanisms(model: DecoderModel) -> dict[str, str]:
    return {
        **{f"linear {name}": plan for name, plan in model.linear_plans().items()},
        "attention": f"blocks of {key_blocks.KV_BLOCK} keys, a row's last one padded to a multiple of "
        f"{key_blocks.KV_ALIGN} (masked), queries to {key_blocks.Q_ALIGN} rows, combined in block order in float32",
        "tp groups": f"{model.tp_groups} per projection at every TP size, partials summed pairwise in float32",
    }


def block_attention_probe(
    lengths: tuple[int, ...], block: int, dtype: torch.dtype, device: torch.device,
    heads: tuple[int, int, int] = (4, 2, 32), chunk: int = 12, seed: int = 0,
) -> list[str]:
    """Blocked attention of sequences of `lengths` keys (block size `block`, heads (H, Hkv, d)) in three
    shapes of call: each sequence's last `chunk` rows as prefill chunks of one step, every one of those
    rows alone, and the sequences' last rows as one decode step. What differed (nothing: invariant)."""
    gen = torch.Generator().manual_seed(seed)
    H, Hkv, d = heads
    keys = [torch.randn(n, 2, Hkv, d, generator=gen).to(device=device, dtype=dtype) for n in lengths]
    queries = [torch.randn(min(n, chunk), H, d, generator=gen).to(device=device, dtype=dtype) for n in lengths]

    def attend(rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """(sequence, first query row, rows) runs, stacked in that order."""
        specs, start = [], 0
        for s, a, n in rows:
            seen = lengths[s] - len(queries[s]) + a + 1
            specs.append(key_blocks.QueryRows(s, start, tuple(range(seen, seen + n))))
            start += n
        plan = key_blocks.plan(specs, start, device, block)
        q = torch.cat([queries[s][a : a + n] for s, a, n in rows])

        def read(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            r = plan.reads[i]
            kv = torch.zeros(len(r.entries), r.length, 2, Hkv, d, dtype=dtype, device=device)
            for row, (s, first) in zip(kv, r.entries):
                got = keys[s][first : first + r.length]
                row[: got.shape[0]] = got
            kv = kv.flatten(0, 1)
            return kv[:, 0], kv[:, 1]

        return ops.block_attention(q, plan, read, d**-0.5)

    alone = [torch.cat([attend([(s, a, 1)]) for a in range(len(q))]) for s, q in enumerate(queries)]
    chunks = attend([(s, 0, len(q)) for s, q in enumerate(queries)]).split([len(q) for q in queries])
    decode = attend([(s, len(q) - 1, 1) for s, q in enumerate(queries)])
    failed = [f"{n} keys: a prefill chunk's rows differ from the rows alone"
              for n, got, want in zip(lengths, chunks, alone) if not torch.equal(got, want)]  # fmt: skip
    failed += [f"{n} keys: a decode step batched with others differs from the row alone"
               for n, got, want in zip(lengths, decode, alone) if not torch.equal(got, want[-1])]  # fmt: skip
    return failed


def self_check(model: DecoderModel) -> InvarianceReport:
    """Whether this rank's layers give bitwise the same output for a token however its sequence is
    chunked and batched, on this machine, device and dtype. It runs the first layer of each distinct kind
    (probe_layers.py: the others make the same kernel calls), then the final norm and head."""
    started = time.perf_counter()
    layers = representative_layers(model)
    probed = over_layers(model, layers)
    pages = 3 * REGION // 16
    sharding = model.kv_sharding  # with pages sharded the probe runs on the ranks' gathered backend too
    pool = DeviceKVPool(probed.kv_layout, probed.num_local_layers, pages, 16, model.dtype, model.device,
                        sharding.size, sharding.rank)  # fmt: skip
    inputs = probe_inputs(model, PROBE_LEN, seed=0)
    other = probe_inputs(model, 1, seed=1)
    cuts = list(torch.tensor(PROBE_CHUNKS).cumsum(0).tolist())
    whole = feed(probed, pool, inputs, [PROBE_LEN], 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = feed(probed, pool, inputs, [PROBE_LEN], 0)
    finally:
        torch.set_num_threads(threads)
    runs = {
        "chunks of 1-10 rows": feed(probed, pool, inputs, cuts, REGION),
        "decode steps batched with another sequence": feed(
            probed, pool, inputs, [PROBE_LEN - 2, PROBE_LEN - 1, PROBE_LEN], REGION, extra=(other, 2 * REGION)
        ),
    }
    failed = [
        f"{name}: max |diff| {float((got.float() - whole.float()).abs().max()):.3g}"
        for name, got in runs.items()
        if not torch.equal(got, whole)
    ]
    failed += block_attention_probe(PROBE_BLOCK_LENGTHS, PROBE_BLOCK, model.dtype, model.device)
    seconds = time.perf_counter() - started
    same_at_one_thread = torch.equal(one_thread, whole)
    report = InvarianceReport(not failed, mechanisms(model), "; ".join(failed), seconds, same_at_one_thread)
    if not same_at_one_thread:
        logger.warning(
            "kernels round differently at %d threads than at one here (max |diff| %.3g): other TP sizes and "
            "thread counts compute other bits, so this rank's stored pages are kept apart from theirs",
            threads, float((one_thread.float() - whole.float()).abs().max()),
        )  # fmt: skip
    if report.verified:
        logger.info("batch invariance verified in %.2f s over local layers %s of %d (%s)", report.seconds, layers,
                    model.num_local_layers, report.mechanisms)  # fmt: skip
    else:
        logger.error("batch invariance self-check FAILED on this machine: %s", report.detail)
    return report
