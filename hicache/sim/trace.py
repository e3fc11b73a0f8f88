"""Request traces for the capacity simulator (docs/DESIGN.md, "capacity simulator"): what arrives when,
with which prompt tokens and how many output tokens.

Two sources: `hicache bench`'s generated workloads (hicache/bench/workload.py), each turn arriving when
its conversation's previous turn ends, as the benchmark sends them; and Mooncake's JSONL traces
(`timestamp` in ms, `input_length`, `output_length`, `hash_ids`), arriving at their timestamps, each
hash id a block of 512 tokens derived from the id alone, so equal hash ids mean equal tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from hicache.bench.workload import Workload, conversation_messages
from hicache.errors import UserError
from hicache.model.tokenizer import Tokenizer

MOONCAKE_BLOCK_TOKENS = 512
# Seeds' first words: answers and hash blocks draw from separate streams, so no answer equals a block.
ANSWER_STREAM, BLOCK_STREAM = 1, 2


@dataclass(frozen=True)
class TraceRequest:
    conv_id: int
    group: int
    round: int
    arrival_s: float  # after the previous turn of its conversation ends, if `after_previous`; else absolute
    prompt: Callable[[], list[int]]  # built when it arrives: a trace's prompts together may not fit in memory
    output_ids: tuple[int, ...]  # what the simulated model answers
    after_previous: bool = False


def answer_tokens(seed: int, length: int, vocab_size: int) -> tuple[int, ...]:
    """A deterministic answer: the tokens a request of this seed generates in the simulator."""
    return tuple(np.random.default_rng([ANSWER_STREAM, seed]).integers(0, vocab_size, length).tolist())


def from_workload(workload: Workload, tokenizer: Tokenizer) -> list[TraceRequest]:
    """Every turn of every conversation; a turn's prompt is the conversation so far (its messages'
    tokens, without a chat template), its earlier answers the simulated ones."""
    requests = []
    for conv in workload.conversations:
        answers: list[tuple[int, ...]] = []
        for turn, spec in enumerate(conv.turns):
            messages = conversation_messages(conv, turn, ["" for _ in answers])
            prompt = _interleave([tokenizer.encode(m["content"]) for m in messages if m["role"] != "assistant"],
                                 answers, has_system=bool(conv.system_prompt))  # fmt: skip
            answer = answer_tokens(conv.conv_id * 1000 + turn, spec.output_len, tokenizer.vocab_size)
            requests.append(TraceRequest(
                conv.conv_id, conv.group, turn, conv.start_offset_s if turn == 0 else 0.0,
                _fixed(prompt), answer, after_previous=turn > 0,
            ))  # fmt: skip
            answers.append(answer)
    return requests


def _interleave(said: list[list[int]], answers: list[tuple[int, ...]], has_system: bool) -> list[int]:
    """The system prompt, then each question followed by its answer (the last question has none yet)."""
    tokens = list(said[0]) if has_system else []
    for k, question in enumerate(said[1:] if has_system else said):
        tokens += question
        if k < len(answers):
            tokens += answers[k]
    return tokens


def _fixed(prompt: list[int]) -> Callable[[], list[int]]:
    return lambda: list(prompt)


def read_mooncake(path: str, vocab_size: int) -> list[TraceRequest]:
    """A Mooncake JSONL trace; UserError (one line) naming the line that is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as exc:
        raise UserError(f"cannot read trace {path}: {exc.strerror}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            timestamp_ms, length = float(row["timestamp"]), int(row["input_length"])
            output, hash_ids = int(row["output_length"]), tuple(int(h) for h in row["hash_ids"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path}:{number}: not a Mooncake trace row ({type(exc).__name__}: {exc})") from None
        if length <= 0 or output <= 0 or length > len(hash_ids) * MOONCAKE_BLOCK_TOKENS:
            blocks = f"{len(hash_ids)} blocks of {MOONCAKE_BLOCK_TOKENS} tokens"
            raise UserError(f"{path}:{number}: input_length {length} and output_length {output} must be positive, "
                            f"the input within its {blocks}")  # fmt: skip
        answer = answer_tokens(number, output, vocab_size)
        prompt = _blocks(hash_ids, length, vocab_size)
        requests.append(TraceRequest(number - 1, 0, 0, timestamp_ms / 1000, prompt, answer))
    return requests


def _blocks(hash_ids: tuple[int, ...], length: int, vocab_size: int) -> Callable[[], list[int]]:
    def prompt() -> list[int]:
        return np.concatenate([_block(h, vocab_size) for h in hash_ids]).tolist()[:length]

    return prompt


@lru_cache(maxsize=4096)
def _block(hash_id: int, vocab_size: int) -> np.ndarray:
    return np.random.default_rng([BLOCK_STREAM, hash_id]).integers(0, vocab_size, MOONCAKE_BLOCK_TOKENS)
