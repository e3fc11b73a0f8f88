"""Benchmark workloads (the `bench` part of the design): multi-turn conversations whose lengths are given
in the target model's tokens.

Two datasets, both built from random text of an exact token length:

- `generated-shared-prefix` (SGLang's flag names and meaning): `num_groups` groups of
  `prompts_per_group` conversations; the conversations of a group share one system prompt. Each
  conversation has `num_turns` questions. Lengths are sampled uniformly in
  `[range_ratio * len, len]`: one system-prompt length per group, one question length per turn and one
  output length per conversation (as SGLang samples them). Conversations are shuffled, so groups
  interleave.
- `multi-round` (the shape of LMCache's multi-round QA benchmark): `num_users` users share one system
  prompt; each user has a private history document (sent with its first question) and asks
  `num_rounds` questions; user `u` joins `u * user_join_interval_s` seconds after the start.

A turn's prompt is the whole conversation so far (system prompt, earlier questions, the server's actual
earlier answers) plus the new question, as agents send it; `conversation_messages` builds it.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import asdict, dataclass

from hicache.errors import UserError
from hicache.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GSP = "generated-shared-prefix"
MULTI_ROUND = "multi-round"
DATASETS = (GSP, MULTI_ROUND)

# Plain words (optionally with their leading space) re-encode to themselves when concatenated, so a text
# built from them lands on the requested token count in one or two corrections.
_WORD = re.compile(r"^ ?[A-Za-z]{1,16}$")


@dataclass(frozen=True)
class Turn:
    question: str
    output_len: int


@dataclass(frozen=True)
class Conversation:
    """One conversation. `context` (may be empty) is prepended to the first question; `group` names the
    conversations that share `system_prompt`."""

    conv_id: int
    group: int
    system_prompt: str
    context: str
    turns: tuple[Turn, ...]
    start_offset_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    dataset: str
    params: dict[str, object]
    conversations: tuple[Conversation, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def num_rounds(self) -> int:
        return max((len(c.turns) for c in self.conversations), default=0)


@dataclass(frozen=True)
class GSPParams:
    """`--dataset generated-shared-prefix`; field names are SGLang's `--gsp-*` flags."""

    num_groups: int = 4
    prompts_per_group: int = 8
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 64
    num_turns: int = 1
    range_ratio: float = 1.0
    seed: int = 1

    def __post_init__(self) -> None:
        _positive(self, "num_groups", "prompts_per_group", "output_len", "num_turns")
        _non_negative(self, "system_prompt_len", "question_len")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise UserError(f"--gsp-range-ratio must be in [0, 1], got {self.range_ratio}")


@dataclass(frozen=True)
class MultiRoundParams:
    """`--dataset multi-round` (LMCache multi-round QA shape)."""

    num_users: int = 8
    num_rounds: int = 4
    shared_system_prompt_len: int = 1000
    user_history_prompt_len: int = 2000
    question_len: int = 32
    answer_len: int = 64
    user_join_interval_s: float = 0.5
    seed: int = 1

    def __post_init__(self) -> None:
        _positive(self, "num_users", "num_rounds", "answer_len")
        _non_negative(self, "shared_system_prompt_len", "user_history_prompt_len", "question_len")
        if self.user_join_interval_s < 0:
            raise UserError(f"--user-join-interval must be >= 0, got {self.user_join_interval_s}")


def _positive(params: object, *names: str) -> None:
    for name in names:
        if getattr(params, name) <= 0:
            raise UserError(f"{name.replace('_', '-')} must be positive, got {getattr(params, name)}")


def _non_negative(params: object, *names: str) -> None:
    for name in names:
        if getattr(params, name) < 0:
            raise UserError(f"{name.replace('_', '-')} must be >= 0, got {getattr(params, name)}")


class TextSampler:
    """Random text of an exact length in a tokenizer's tokens: `len(tokenizer.encode(text(n))) == n`.

    Draws from tokens that decode to a plain word; when the vocabulary has enough space-prefixed words
    (BPE vocabularies), only those are used, since a word after a space never merges with its neighbour.
    """

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self._tokenizer = tokenizer
        self._rng = rng
        words: list[int] = []
        spaced: list[int] = []
        for token_id in range(tokenizer.vocab_size):
            piece = tokenizer.decode([token_id])
            if _WORD.match(piece) and tokenizer.encode(piece) == [token_id]:
                words.append(token_id)
                if piece.startswith(" "):
                    spaced.append(token_id)
        self._pool = spaced if len(spaced) >= 64 else words
        if not self._pool:
            raise UserError("the tokenizer has no plain-word tokens to build benchmark text from")

    def text(self, num_tokens: int) -> str:
        if num_tokens == 0:
            return ""
        ids = self._rng.choices(self._pool, k=num_tokens)
        # Re-encoding decoded ids can merge or split a few tokens at word boundaries: trim or extend until
        # the count is exact (one or two rounds in practice).
        for _ in range(32):
            text = self._tokenizer.decode(ids)
            got = len(self._tokenizer.encode(text))
            if got == num_tokens:
                return text
            if got > num_tokens:
                ids = ids[: max(1, len(ids) - (got - num_tokens))]
            else:
                ids += self._rng.choices(self._pool, k=num_tokens - got)
        raise RuntimeError(f"could not build a text of exactly {num_tokens} tokens")


def sample_len(rng: random.Random, full_len: int, range_ratio: float, minimum: int = 0) -> int:
    """A length uniform in [range_ratio * full_len, full_len], as SGLang's `compute_random_lens`."""
    return max(minimum, rng.randint(int(full_len * range_ratio), full_len))


def generated_shared_prefix(params: GSPParams, tokenizer: Tokenizer) -> Workload:
    rng = random.Random(params.seed)
    sampler = TextSampler(tokenizer, rng)
    system_prompts = [
        sampler.text(sample_len(rng, params.system_prompt_len, params.range_ratio)) for _ in range(params.num_groups)
    ]
    conversations = []
    for group in range(params.num_groups):
        for index in range(params.prompts_per_group):
            output_len = sample_len(rng, params.output_len, params.range_ratio, minimum=1)
            turns = tuple(
                Turn(sampler.text(sample_len(rng, params.question_len, params.range_ratio)), output_len)
                for _ in range(params.num_turns)
            )
            conv_id = group * params.prompts_per_group + index
            conversations.append(Conversation(conv_id, group, system_prompts[group], "", turns))
    rng.shuffle(conversations)
    return Workload(GSP, asdict(params), tuple(conversations))


def multi_round(params: MultiRoundParams, tokenizer: Tokenizer) -> Workload:
    rng = random.Random(params.seed)
    sampler = TextSampler(tokenizer, rng)
    system_prompt = sampler.text(params.shared_system_prompt_len)
    conversations = []
    for user in range(params.num_users):
        history = sampler.text(params.user_history_prompt_len)
        turns = tuple(Turn(sampler.text(params.question_len), params.answer_len) for _ in range(params.num_rounds))
        # Every user shares the one system prompt: group 0 for all.
        conversations.append(
            Conversation(user, 0, system_prompt, history, turns, start_offset_s=user * params.user_join_interval_s)
        )
    return Workload(MULTI_ROUND, asdict(params), tuple(conversations))


def build_workload(params: GSPParams | MultiRoundParams, tokenizer: Tokenizer) -> Workload:
    if isinstance(params, GSPParams):
        workload = generated_shared_prefix(params, tokenizer)
    else:
        workload = multi_round(params, tokenizer)
    logger.info(
        "workload %s: %d conversations, %d requests",
        workload.dataset,
        len(workload.conversations),
        workload.num_requests,
    )
    return workload


def conversation_messages(conv: Conversation, turn: int, answers: list[str]) -> list[dict[str, str]]:
    """The chat messages of `conv`'s turn `turn` (0-based): everything said so far plus the new question.
    `answers` holds the server's answers to the earlier turns."""
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
    messages = [{"role": "system", "content": conv.system_prompt}] if conv.system_prompt else []
    for k in range(turn + 1):
        question = conv.turns[k].question
        if k == 0 and conv.context:
            question = f"{conv.context}\n\n{question}"
        messages.append({"role": "user", "content": question})
        if k < turn:
            messages.append({"role": "assistant", "content": answers[k]})
    return messages


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of model `name` (any `--model` value hicache accepts).

    NOTE: the loaders have no tokenizer-only entry point yet, so this loads the weights too (about 2 s
    for smollm2) and drops them.
    """
    from hicache.model.loading.loader import load_model

    try:
        return load_model(name).tokenizer
    except UserError as exc:
        raise UserError(f"cannot load the tokenizer of {name!r} ({exc}); pass --tokenizer") from None
