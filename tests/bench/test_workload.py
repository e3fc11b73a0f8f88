"""Benchmark workloads: shape, exact token lengths (byte tokenizer and SmolLM2's BPE), range ratio,
determinism, and multi-turn histories that grow by the earlier answers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from hicache.bench.workload import (
    GSPParams,
    MultiRoundParams,
    TextSampler,
    conversation_messages,
    generated_shared_prefix,
    load_tokenizer,
    multi_round,
)
from hicache.errors import UserError
from hicache.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return load_tokenizer("tiny")


def n_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text))


def test_gsp_shape_and_exact_lengths(tiny: Tokenizer) -> None:
    params = GSPParams(
        num_groups=3, prompts_per_group=2, system_prompt_len=50, question_len=10, output_len=7, num_turns=4, seed=5
    )
    workload = generated_shared_prefix(params, tiny)
    convs = workload.conversations
    assert len(convs) == 6 and workload.num_requests == 24 and workload.num_rounds == 4
    assert sorted(c.conv_id for c in convs) == list(range(6))
    assert Counter(c.group for c in convs) == {0: 2, 1: 2, 2: 2}
    by_group = {g: {c.system_prompt for c in convs if c.group == g} for g in range(3)}
    assert all(len(prompts) == 1 for prompts in by_group.values())  # shared within a group
    assert len(set.union(*by_group.values())) == 3  # and different across groups
    for conv in convs:
        assert n_tokens(tiny, conv.system_prompt) == 50 and conv.context == "" and conv.start_offset_s == 0
        assert len(conv.turns) == 4
        for turn in conv.turns:
            assert n_tokens(tiny, turn.question) == 10 and turn.output_len == 7
    assert len({t.question for c in convs for t in c.turns}) == 24


def test_gsp_range_ratio_samples_within_bounds(tiny: Tokenizer) -> None:
    params = GSPParams(num_groups=8, prompts_per_group=4, system_prompt_len=40, question_len=20, output_len=10,
                       num_turns=3, range_ratio=0.5)  # fmt: skip
    convs = generated_shared_prefix(params, tiny).conversations
    system_lens = {n_tokens(tiny, c.system_prompt) for c in convs}
    question_lens = {n_tokens(tiny, t.question) for c in convs for t in c.turns}
    output_lens = {t.output_len for c in convs for t in c.turns}
    assert system_lens <= set(range(20, 41)) and len(system_lens) > 1
    assert question_lens <= set(range(10, 21)) and len(question_lens) > 1
    assert output_lens <= set(range(5, 11)) and len(output_lens) > 1
    for conv in convs:  # one output length per conversation, as SGLang samples it
        assert len({t.output_len for t in conv.turns}) == 1


def test_gsp_is_deterministic_per_seed(tiny: Tokenizer) -> None:
    params = GSPParams(num_groups=2, prompts_per_group=2, system_prompt_len=16, question_len=4, num_turns=2)
    assert generated_shared_prefix(params, tiny) == generated_shared_prefix(params, tiny)
    other = GSPParams(num_groups=2, prompts_per_group=2, system_prompt_len=16, question_len=4, num_turns=2, seed=2)
    assert generated_shared_prefix(other, tiny) != generated_shared_prefix(params, tiny)


def test_multi_round_shape(tiny: Tokenizer) -> None:
    params = MultiRoundParams(num_users=3, num_rounds=2, shared_system_prompt_len=40, user_history_prompt_len=30,
                              question_len=5, answer_len=6, user_join_interval_s=0.25)  # fmt: skip
    convs = multi_round(params, tiny).conversations
    assert [c.conv_id for c in convs] == [0, 1, 2]
    assert [c.start_offset_s for c in convs] == [0.0, 0.25, 0.5]
    assert len({c.system_prompt for c in convs}) == 1 and n_tokens(tiny, convs[0].system_prompt) == 40
    assert len({c.context for c in convs}) == 3
    assert all(n_tokens(tiny, c.context) == 30 for c in convs)
    assert all(
        len(c.turns) == 2 and all(n_tokens(tiny, t.question) == 5 and t.output_len == 6 for t in c.turns) for c in convs
    )


def test_messages_carry_the_whole_history(tiny: Tokenizer) -> None:
    params = MultiRoundParams(
        num_users=1, num_rounds=3, shared_system_prompt_len=8, user_history_prompt_len=6, question_len=3, answer_len=4
    )
    conv = multi_round(params, tiny).conversations[0]
    answers = ["first answer", "second answer"]
    messages = conversation_messages(conv, 2, answers)
    q = [t.question for t in conv.turns]
    assert messages == [
        {"role": "system", "content": conv.system_prompt},
        {"role": "user", "content": f"{conv.context}\n\n{q[0]}"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": q[1]},
        {"role": "assistant", "content": "second answer"},
        {"role": "user", "content": q[2]},
    ]
    # Each turn's prompt extends the previous turn's messages: what a prefix cache reuses.
    render = tiny.chat_template.render
    for turn in (1, 2):
        before = render(conversation_messages(conv, turn - 1, answers), add_generation_prompt=False)
        assert render(conversation_messages(conv, turn, answers)).startswith(before)
    with pytest.raises(ValueError):
        conversation_messages(conv, 2, answers[:1])


def test_bad_parameters_are_user_errors() -> None:
    with pytest.raises(UserError):
        GSPParams(num_groups=0)
    with pytest.raises(UserError):
        GSPParams(range_ratio=1.5)
    with pytest.raises(UserError):
        MultiRoundParams(user_join_interval_s=-1)


def test_text_sampler_is_exact_for_a_trained_bpe() -> None:
    """A small byte-level BPE trained here: words merge and split at boundaries as in real vocabularies."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from hicache.model.chat import ChatTemplate
    from hicache.model.loading.hf_tokenizer import HFTokenizer

    rng = random.Random(3)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(400)]
    corpus = [" ".join(rng.choices(words, k=50)) for _ in range(200)]
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tokenizer = HFTokenizer(bpe, None, [], ChatTemplate.plain())
    sampler = TextSampler(tokenizer, random.Random(0))
    for n in (0, 1, 2, 3, 17, 100, 999, 2048):
        assert n_tokens(tokenizer, sampler.text(n)) == n


@pytest.mark.slow
def test_text_sampler_is_exact_for_smollm2() -> None:
    from hicache.model.loading.gguf_loader import smollm2_path

    try:
        smollm2_path()
    except UserError as exc:
        pytest.skip(str(exc))
    tokenizer = load_tokenizer("smollm2")
    sampler = TextSampler(tokenizer, random.Random(0))
    for n in (0, 1, 2, 3, 17, 100, 999, 2048):
        assert n_tokens(tokenizer, sampler.text(n)) == n
