"""The numerical ground the cache invariant stands on: a token's logits do not depend on how its
sequence was cut into prefill chunks and decode steps, nor on which other requests share the step.
If this fails on a platform, cache-on and cache-off outputs can differ there in the last bits."""

import random

import pytest
import torch

from hicache.config import EngineConfig
from hicache.dist.parallel import ParallelContext
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.batch import ForwardBatch, KV_ALIGN, SeqSlice
from hicache.model.llama import LlamaModel
from hicache.model.loader import load_model


def _run(model: LlamaModel, pool: DeviceKVPool, ids: list[int], cuts: list[int], base_slot: int, extra=None):
    """Feed `ids` in chunks ending at `cuts`; returns the logits of every token, stacked."""
    out, start = [], 0
    for end in cuts:
        kv_len = end
        padded = -(-kv_len // KV_ALIGN) * KV_ALIGN
        slots = torch.zeros(padded, dtype=torch.int64)
        slots[:kv_len] = torch.arange(base_slot, base_slot + kv_len)
        seqs = [SeqSlice(0, end - start, slots, kv_len)]
        input_ids = ids[start:end]
        positions = list(range(start, end))
        out_slots = list(range(base_slot + start, base_slot + end))
        if extra is not None:  # an unrelated request sharing the step
            e_ids, e_base = extra
            seqs.append(SeqSlice(len(input_ids), len(e_ids), torch.arange(e_base, e_base + KV_ALIGN), len(e_ids)))
            input_ids = input_ids + e_ids
            positions = positions + list(range(len(e_ids)))
            out_slots = out_slots + list(range(e_base, e_base + len(e_ids)))
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids),
            positions=torch.tensor(positions),
            out_slots=torch.tensor(out_slots),
            seqs=seqs,
            logit_rows=torch.arange(end - start),
        )
        out.append(model.forward(batch, pool))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("name,length", [("tiny", 1300), ("smollm2", 560)])
def test_logits_independent_of_chunking_and_batch(name, length):
    loaded = load_model(name)
    dtype = EngineConfig().resolved_dtype()
    model = LlamaModel(loaded.config, loaded.weights, ParallelContext(), dtype, torch.device("cpu"))
    region = -(-length // KV_ALIGN) * KV_ALIGN  # three disjoint slot regions: whole, chunked, the other request
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, 3 * region // 16 + KV_ALIGN // 16, 16, dtype, torch.device("cpu"))
    rng = random.Random(0)
    ids = [rng.randrange(0, loaded.config.vocab_size) for _ in range(length)]
    whole = _run(model, pool, ids, [length], 0)
    cuts, pos = [], 0
    while pos < length - 3:
        pos = min(length - 3, pos + rng.choice([1, 2, 3, 17, 64, 200]))
        cuts.append(pos)
    cuts += [length - 2, length - 1, length]  # the tail as decode steps
    chunked = _run(model, pool, ids, cuts, region, extra=([5, 6, 7], 2 * region))
    assert torch.equal(whole, chunked), f"max |diff| {float((whole - chunked).abs().max())}"
    # Decode steps batched with another decoding sequence (one attention call for both).
    batched = _run(model, pool, ids, cuts, region, extra=([9], 2 * region))
    assert torch.equal(whole, batched), f"max |diff| {float((whole - batched).abs().max())}"
