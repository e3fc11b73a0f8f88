"""`tiny-hybrid` (hicache/model/families/hybrid.py): a token's logits are the same bits however its sequence
is cut into chunks (also off page boundaries, where the recurrent state is replayed from the last
snapshot) or batched with another sequence; the state snapshot in the pool is what the tokens after a
restored prefix read (zeroing it changes them); the self-check, which runs one layer of each kind, catches
a non-invariant linear in a layer of any kind; a config whose layer kinds do not fit is refused."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.model.batch import ForwardBatch, SeqSlice
from hicache.model.build import build_decoder
from hicache.model.families.hybrid import FULL, LINEAR, LINEAR_STATE, SLIDING, HybridModel
from hicache.model.families.tiny_hybrid import TINY_HYBRID_CONFIG
from hicache.model.kernels import ops
from hicache.model.kernels.invariance import feed, probe_inputs, self_check
from hicache.model.kernels.probe_layers import representative_layers
from hicache.model.kernels.tp_groups import RowGroups, group_slices
from hicache.model.loading.loader import load_model
from hicache.parallel.parallel import ParallelContext
from tests.model.test_ops import RowCountDependent

PAGE = 16
LENGTH = 160  # past the 64-token window, across ten page boundaries
REGION = 192  # slots per sequence in the test pool


@pytest.fixture(scope="module")
def model() -> HybridModel:
    built = build_decoder(load_model("tiny-hybrid"), ParallelContext(), torch.float32, torch.device("cpu"))
    assert isinstance(built, HybridModel)
    return built


@pytest.fixture(scope="module")
def whole(model):
    """The sequence's logits from one prefill of all of it, computed once."""
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, REGION // PAGE, PAGE, model.dtype, model.device)
    return feed(model, pool, probe_inputs(model, LENGTH, seed=0), [LENGTH], 0)


def fresh_pool(model: HybridModel) -> DeviceKVPool:
    return DeviceKVPool(model.kv_layout, model.num_local_layers, 3 * REGION // PAGE, PAGE, model.dtype, model.device)


@pytest.mark.slow
def test_the_self_check_passes_and_the_layout_holds_the_recurrent_state(model):
    assert model.invariance is not None and model.invariance.verified, model.invariance
    # The recurrent layer's columns (k, v, gate: 66; a snapshot share: 32) lie over attention's K and V
    # (128), so a row is as wide as tiny's.
    assert [c.name for c in model.kv_layout.components] == ["k", "v"] and model.kv_layout.row_numel == 128
    assert [c.name for c in model.linear_layout.components] == ["linear_k", "linear_v", "linear_gate", "linear_state"]
    assert model.layer_types == (SLIDING, LINEAR, SLIDING, FULL)


@pytest.mark.parametrize(
    "cuts",
    [
        [37, 38, 64, 101, 150, 160],  # chunks ending off and on page boundaries, a one-token chunk
        [48, 96, 144, 160],
        list(range(150, 161)),  # decode steps after a prefill
    ],
)
def test_chunks_give_the_bits_of_one_prefill(model, whole, cuts):
    got = feed(model, fresh_pool(model), probe_inputs(model, LENGTH, seed=0), cuts, 0)
    assert torch.equal(got, whole), f"max |diff| {float((got - whole).abs().max()):.3g}"


def test_decode_steps_batched_with_another_sequence_give_the_same_bits(model, whole):
    other = (probe_inputs(model, 7, seed=3), 2 * REGION)  # a 7-token prefill sharing every step
    got = feed(model, fresh_pool(model), probe_inputs(model, LENGTH, seed=0), [157, 158, 159, 160], 0, extra=other)
    assert torch.equal(got, whole)


def test_the_tokens_after_a_prefix_read_its_state_snapshot(model, whole):
    """A prefix of 96 tokens (six pages) is in the pool, as a cache hit leaves it; zeroing its state
    snapshots, as a cache keeping the KV but not the recurrent state would, changes what follows."""
    pool = fresh_pool(model)
    inputs = probe_inputs(model, LENGTH, seed=0)
    feed(model, pool, inputs, [96], 0)
    assert torch.equal(rest_after_prefix(model, pool, inputs, 96), whole[96:])
    offset, numel = model.linear_layout.span(LINEAR_STATE)
    pool.buffers[model.layer_types.index(LINEAR)][:, offset : offset + numel] = 0
    got = rest_after_prefix(model, pool, inputs, 96)
    assert not torch.equal(got, whole[96:]), "the tokens after the prefix did not read its state"


def rest_after_prefix(model: HybridModel, pool: DeviceKVPool, inputs: torch.Tensor, prefix: int) -> torch.Tensor:
    """The logits of inputs[prefix:] in one chunk over the prefix's KV and state already in the pool at
    slots 0.., as a request whose prefix is a cache hit computes them."""
    n = LENGTH - prefix
    batch = ForwardBatch(input_ids=inputs[prefix:], positions=torch.arange(prefix, LENGTH),
                         out_slots=torch.arange(prefix, LENGTH), seqs=[SeqSlice(0, n, torch.arange(LENGTH))],
                         logit_rows=torch.arange(n))  # fmt: skip
    return model.forward(batch, pool)


def test_in_bfloat16_the_state_is_rounded_at_each_snapshot_so_chunking_keeps_the_bits():
    """In bf16 a restored snapshot is the state rounded to bf16: a run computing through the boundary must
    round there too (`ordered.gated_scan`), or chunks and decode steps differ (0.125 in the logits without
    it). The start-up self-check probes exactly that: chunks of 1-10 rows and batched decode steps."""
    built = build_decoder(load_model("tiny-hybrid"), ParallelContext(), torch.bfloat16, torch.device("cpu"))
    assert built.invariance is not None and built.invariance.verified, built.invariance.detail


@pytest.mark.parametrize("kind", [SLIDING, LINEAR])  # full attention: tests/model/test_ops.py
def test_a_non_invariant_linear_in_the_last_layer_of_any_kind_fails_the_self_check(model, kind, monkeypatch):
    """The self-check runs the first layer of each kind; a layer whose MLP runs on a GEMM that rounds one-row
    calls otherwise (the last sliding layer is not the first one of its kind) is a kind of its own, so it is
    run, and caught."""
    assert representative_layers(model) == [0, 1, 3]  # sliding, linear attention, full attention
    monkeypatch.setitem(ops.BACKENDS, RowCountDependent.name, RowCountDependent())
    last = max(i for i, k in enumerate(model.layer_types) if k == kind)
    layer = copy.copy(model.layers[last])
    weight = load_model("tiny-hybrid").weights[f"model.layers.{last}.mlp.down_proj.weight"]
    columns = group_slices(model.cfg.intermediate_size, model.tp_groups, *layer.group_range)
    layer.down_proj = RowGroups([weight[:, c] for c in columns],
                                lambda w: ops.Linear(w.contiguous(), ops.LinearPlan(RowCountDependent.name),
                                                     model.dtype), model.pctx)  # fmt: skip
    broken = copy.copy(model)  # the module's model stays as built
    broken.layers = [layer if i == last else other for i, other in enumerate(model.layers)]
    assert last in representative_layers(broken)
    report = self_check(broken)
    assert not report.verified and "chunks of 1-10 rows" in report.detail, report


def test_layer_kinds_that_do_not_fit_the_model_are_refused():
    with pytest.raises(ValueError, match="layer_types lists 3 layers, the model has 4"):
        replace(TINY_HYBRID_CONFIG, layer_types=(SLIDING, LINEAR, FULL))
    with pytest.raises(ValueError, match=r"unknown layer types \['mamba'\]"):
        replace(TINY_HYBRID_CONFIG, layer_types=(SLIDING, "mamba", SLIDING, FULL))
