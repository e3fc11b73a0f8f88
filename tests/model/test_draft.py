"""The built-in drafts (hicache/model/loading/draft.py, hicache/model/families/shift.py and mtp.py): cut
from the target's own layers, the packed one with the target's KV geometry, the sidecar one with a
token-shift state beside its KV that the model really reads back (a cache that dropped it would change the
draft's output), the MTP head with the target's hidden states beside its KV, read back the same way,
batch-invariant like the target; a draft with another vocabulary is refused."""

from dataclasses import replace

import pytest
import torch

from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.batch import ForwardBatch, SeqSlice
from hicache.model.build import build_decoder
from hicache.model.families.mtp import HIDDEN, MTPHeadModel
from hicache.model.families.shift import SHIFT, TokenShiftModel
from hicache.model.families.tiny import load_tiny
from hicache.model.loading.draft import load_draft
from hicache.parallel.parallel import ParallelContext

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def build(loaded, dtype=torch.float32):
    return build_decoder(loaded, ParallelContext(), dtype, CPU)


@pytest.mark.slow
def test_the_packed_draft_is_the_targets_first_layers_with_its_kv_geometry(tiny):
    draft = load_draft("tiny-draft-packed", tiny)
    assert draft.config.num_layers < tiny.config.num_layers and draft.weights is tiny.weights
    assert draft.identity != tiny.identity
    assert build(draft).kv_layout == build(tiny).kv_layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sidecar_draft_keeps_a_state_beside_its_kv_and_stays_batch_invariant(tiny, dtype):
    model = build(load_draft("tiny-draft-sidecar", tiny), dtype)
    assert isinstance(model, TokenShiftModel)
    assert [c.name for c in model.kv_layout.components] == ["k", "v", SHIFT]
    assert model.invariance.verified, model.invariance.detail


def forward(model, pool, ids, start, carried=None):
    """Feed ids at positions start.. (slots = positions), the prefix's KV already in `pool`."""
    n = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(start, start + n),
        out_slots=torch.arange(start, start + n),
        seqs=[SeqSlice(0, n, torch.arange(start + n))],
        logit_rows=torch.tensor([n - 1]),
        carried_hidden=carried,
    )
    return model.forward(batch, pool)


def test_the_sidecar_drafts_output_depends_on_the_stored_state(tiny):
    model = build(load_draft("tiny-draft-sidecar", tiny))
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, 4, 16, torch.float32, CPU)
    prompt = list(range(60, 80))
    whole = forward(model, pool, prompt, 0)
    forward(model, pool, prompt[:-1], 0)
    assert torch.equal(forward(model, pool, prompt[-1:], len(prompt) - 1), whole)  # restored: the same
    offset, numel = model.kv_layout.span(SHIFT)
    for buf in pool.buffers:
        buf[: len(prompt) - 1, offset : offset + numel] = 0  # the KV kept, the state beside it lost
    assert not torch.equal(forward(model, pool, prompt[-1:], len(prompt) - 1), whole)


def test_the_mtp_head_reads_the_targets_hidden_state_from_its_pool_or_as_carried(tiny):
    model = build(load_draft("tiny-mtp", tiny))
    assert isinstance(model, MTPHeadModel) and model.num_local_layers == 1
    assert [c.name for c in model.kv_layout.components] == ["k", "v", HIDDEN]
    assert model.invariance.verified, model.invariance.detail
    pool = DeviceKVPool(model.kv_layout, 1, 4, 16, torch.float32, CPU)
    prompt = list(range(60, 80))
    hidden = torch.randn(len(prompt), tiny.config.hidden_size, generator=torch.Generator().manual_seed(0))
    model.store_target_hidden(pool, torch.arange(len(prompt)), hidden)  # what the target's pass writes
    whole = forward(model, pool, prompt, 0)
    forward(model, pool, prompt[:-1], 0)
    assert torch.equal(forward(model, pool, prompt[-1:], len(prompt) - 1), whole)  # restored: the same
    carried = forward(model, pool, prompt[-1:], len(prompt) - 1, carried=hidden[-2:-1])
    assert torch.equal(carried, whole)  # the predecessor's hidden state given instead of read: the same
    model.store_target_hidden(pool, torch.tensor([len(prompt) - 2]), torch.zeros(1, tiny.config.hidden_size))
    assert not torch.equal(forward(model, pool, prompt[-1:], len(prompt) - 1), whole)  # one hidden state lost


def test_drafts_are_cut_from_the_target_or_refused(tiny):
    named_smollm2 = replace(tiny, name="smollm2")  # stands in for the real one: no GGUF is read
    assert load_draft("smollm2-draft-2", named_smollm2).config.num_layers == 2
    with pytest.raises(UserError, match="a draft needs 1..3"):
        load_draft("smollm2-draft-4", named_smollm2)
    other_vocab = replace(tiny, name="another", config=replace(tiny.config, vocab_size=49152))
    with pytest.raises(UserError, match="must share the target's tokenizer"):
        load_draft("tiny-draft-packed", other_vocab)
