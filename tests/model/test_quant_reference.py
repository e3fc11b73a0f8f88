"""`--quantization auto` on the embedded model against the independent reference (transformers'
float32 Llama on the dequantized GGUF): kept as the checkpoint's int4/int8 codes with bf16
activations (and float32 ones on the native kernels), its next-token distribution stays close to the reference's, step by step.

Measured (benchmarks/reference_agreement.py, AMD EPYC AVX512-BF16, 64 teacher-forced steps): dense
bf16 top-1 0.984, top-5 overlap 0.991; checkpoint formats 0.953 / 0.969, max regret 0.179 nats (an
exact tie of two bf16 logits, broken towards the lower id), every pick inside the reference's top-5;
everything int8 0.938 / 0.944; everything int4 (the head too) 0.812 / 0.884. The bounds leave room
for other CPUs' kernels, not for a broken format (a scrambled nibble order or a dropped zero point puts
most picks outside the top-5)."""

import json

import pytest

from benchmarks.reference_agreement import agreement
from hicache import Engine, SamplingParams
from tests.fixtures import SMOLLM2_REFERENCE
from tests.model.test_quant import BF16_KERNELS, NATIVE_KERNELS

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

# auto keeps the codes with bf16 activations (aten's packed or the native kernels) and, where the
# native kernels are built (hicache/model/kernels/native.py), with float32 ones too.
DTYPES = [
    pytest.param("bfloat16", marks=pytest.mark.skipif(not BF16_KERNELS, reason="no bf16 int4/int8 CPU kernels")),
    pytest.param("float32", marks=pytest.mark.skipif(not NATIVE_KERNELS, reason="native kernels not built")),
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_formats_agree_with_the_reference(dtype):
    reference = json.loads(SMOLLM2_REFERENCE.read_text())
    with Engine(model="smollm2", dtype=dtype, quantization="auto", max_total_tokens=4096) as engine:
        assert engine.weight_format == "checkpoint"
        a = agreement(engine, reference)
    assert a["outside_top5"] == 0, a
    assert a["top1"] >= 0.9 and a["top5_overlap"] >= 0.93 and a["max_regret"] <= 0.3, a


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_conversation_with_the_cache_equals_it_without_in_checkpoint_formats(dtype):
    # Turn 2 resends turn 1 and its answer: with the cache their KV comes from decode steps and the
    # tree, without it from one prefill; the packed kernels must round a row alike in both.
    reference = json.loads(SMOLLM2_REFERENCE.read_text())
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    flags = {"model": "smollm2", "dtype": dtype, "quantization": "auto", "max_total_tokens": 4096}
    outputs = []
    for cache_off in (False, True):
        with Engine(disable_radix_cache=cache_off, **flags) as engine:
            turns = []
            for case in reference["cases"][:2]:
                first = engine.generate([case["prompt_ids"]], params)[0].token_ids
                follow = case["prompt_ids"] + first + case["greedy_ids"][:5]
                turns.append((first, engine.generate([follow], params)[0].token_ids))
            outputs.append(turns)
    assert outputs[0] == outputs[1]
