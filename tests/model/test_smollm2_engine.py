"""The embedded real model through the engine: against an independent reference (transformers' Llama
on the same GGUF, float32, fixture in tests/fixtures), its chat answer, and the cache invariant on a
3-turn conversation."""

import json

import pytest

from hicache import Engine, SamplingParams
from tests.fixtures import SMOLLM2_REFERENCE


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(SMOLLM2_REFERENCE.read_text())


def test_float32_matches_reference_tokens_and_logprobs(reference):
    # Tolerance: the fixture's float32 reference and ours differ only in summation order, ~1e-5 nats
    # measured; 1e-3 leaves room for other CPUs' kernels.
    with Engine(model="smollm2", dtype="float32", max_total_tokens=4096) as engine:
        for case in reference["cases"]:
            params = SamplingParams(max_new_tokens=len(case["greedy_ids"]), logprobs=5, ignore_eos=True)
            result = engine.generate([case["prompt_ids"]], params)[0]
            assert result.token_ids == case["greedy_ids"], case["prompt"]
            for got, step in zip(result.logprobs, case["steps"]):
                assert [t for t, _ in got.top] == step["top_ids"]
                for (_, lp), ref in zip(got.top, step["top_logprobs"]):
                    assert abs(lp - ref) < 1e-3


def test_bfloat16_choices_stay_near_reference_best(reference):
    # Dense bf16 weights (the quantized formats' agreement: test_quant_reference.py).
    with Engine(model="smollm2", dtype="bfloat16", quantization="none", max_total_tokens=4096) as engine:
        for case in reference["cases"]:
            params = SamplingParams(max_new_tokens=len(case["greedy_ids"]), ignore_eos=True)
            tokens = engine.generate([case["prompt_ids"]], params)[0].token_ids
            for got, ref_id, step in zip(tokens, case["greedy_ids"], case["steps"]):
                top = dict(zip(step["top_ids"], step["top_logprobs"]))
                assert got in top and top[got] >= step["top_logprobs"][0] - 0.1, case["prompt"]
                if got != ref_id:
                    break  # past a near-tie the reference's later steps describe another text


@pytest.fixture(scope="module")
def engines():
    with Engine(model="smollm2", max_total_tokens=8192) as on, Engine(
        model="smollm2", max_total_tokens=8192, disable_radix_cache=True
    ) as off:
        yield on, off


def test_chat_answers_paris(engines, reference):
    on, _ = engines
    messages = reference["chat_template_example"]["messages"]
    prompt = on.tokenizer.chat_template.render(messages)
    assert prompt == reference["chat_template_example"]["rendered_with_generation_prompt"]
    result = on.generate([prompt], SamplingParams(max_new_tokens=24))[0]
    assert "Paris" in result.text
    assert result.finish_reason == "stop"  # ends on <|im_end|>, which the text leaves out
    assert "<|im_end|>" not in result.text


def test_three_turn_conversation_same_with_cache(engines):
    on, off = engines
    questions = ["Tell me about the Eiffel Tower.", "How tall is it?", "Who designed it?"]
    transcripts = {}
    for engine in (on, off):
        messages = [{"role": "system", "content": "You are a concise assistant. " * 20}]
        answers = []
        for q in questions:
            messages.append({"role": "user", "content": q})
            r = engine.generate([engine.tokenizer.chat_template.render(messages)], SamplingParams(max_new_tokens=40))[0]
            messages.append({"role": "assistant", "content": r.text})
            answers.append((r.token_ids, r.cached_tokens))
        transcripts[engine is on] = answers
    assert [a for a, _ in transcripts[True]] == [a for a, _ in transcripts[False]]
    assert all(c > 0 for _, c in transcripts[True][1:])
    assert all(c == 0 for _, c in transcripts[False])
    assert on.flush_cache() and on.leak_report() == []
