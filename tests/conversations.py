"""Multi-turn conversation workloads for cache-invariance tests, shared by every tier's tests.

Histories are token ids (prompt + the model's own answer + the next question), never re-encoded text,
so a turn's prompt extends the previous turn's exactly, as an agent's history does.
"""

from __future__ import annotations

import random

from hicache import Engine, SamplingParams


def make_conversations(num_groups: int, per_group: int, system_len: int, question_len: int, seed: int = 0):
    """Token-id system prompts shared within a group, and per-conversation question streams."""
    rng = random.Random(seed)
    convs = []
    for g in range(num_groups):
        system = [rng.randrange(32, 127) for _ in range(system_len)]
        for c in range(per_group):
            convs.append({"system": system, "seed": seed * 1000 + g * 100 + c, "qlen": question_len})
    return convs


def run_turns(engine: Engine, convs, turns: int, max_new_tokens: int, cache_salt: str = ""):
    """All conversations advance one turn at a time, concurrently. Returns per-turn results."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    histories = [list(c["system"]) for c in convs]
    rngs = [random.Random(c["seed"]) for c in convs]
    out = []
    for _ in range(turns):
        for h, c, rng in zip(histories, convs, rngs):
            h.extend(rng.randrange(32, 127) for _ in range(c["qlen"]))
        results = engine.generate([list(h) for h in histories], params, cache_salt=cache_salt)
        for h, r in zip(histories, results):
            h.extend(r.token_ids)
        out.append(results)
    return out


def chat_turns(engine: Engine, system: str, users: list[str], questions: list[str], max_new_tokens: int):
    """Several users' chats on the model's chat template, interleaved turn by turn, each turn carrying its
    whole history (the answers as text). Returns every turn's results, in order."""
    histories = {u: [{"role": "system", "content": f"The user is {u}. " + system}] for u in users}
    out = []
    for q in questions:
        prompts = []
        for u in users:
            histories[u].append({"role": "user", "content": q})
            prompts.append(engine.tokenizer.chat_template.render(histories[u]))
        for u, r in zip(users, engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))):
            histories[u].append({"role": "assistant", "content": r.text})
            out.append(r)
    return out
