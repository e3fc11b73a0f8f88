"""`hicache simulate --calibrate` (docs/DESIGN.md, "capacity simulator"): a cost model measured on this
machine by running the real engine briefly, written as TOML.

Measured, the cache off so nothing hits: the time to first token of prompts of two lengths, and a
decode step at batch 1 and at batch `DECODE_BATCH`, each the fastest of `REPEATS` (on a shared machine
the least disturbed). Fitted to cost.py's step cost:
the decode steps give the fixed cost a step and the cost a decoding request; the two prefills, less
that fixed cost, give the GEMM cost a token and the attention cost a (query, key) pair (t = a n +
b n (n + 1) / 2), hence `flops` and `attention_flops` from the base preset's FLOPs a token and a pair.
The model's constants, the links and storage are the base preset's (a model's, not a machine's, or
measured by benchmarks/hicache_bench.py and storage_bench.py).
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from hicache.config import EngineConfig
from hicache.errors import UserError
from hicache.sim.cost import Compute, CostModel

PREFILL_LENGTHS = (512, 2048)
REPEATS = 5
DECODE_TOKENS = 16
DECODE_BATCH = 8


def calibrate(cfg: EngineConfig, base: CostModel, name: str) -> CostModel:
    """`base` with its compute figures measured on this machine for `cfg`'s model."""
    from hicache import Engine, SamplingParams

    measured = dataclasses.replace(cfg, disable_radix_cache=True, hicache=dataclasses.replace(cfg.hicache,
                                   enable_hierarchical_cache=False, hicache_storage_backend=None))  # fmt: skip
    rng = np.random.default_rng(0)
    with Engine(measured) as engine:
        vocab = engine.tokenizer.vocab_size

        def prompt(n: int) -> list[int]:
            return rng.integers(0, vocab, n).tolist()

        def ttft(n: int) -> float:
            return engine.submit(prompt(n), SamplingParams(max_new_tokens=1, ignore_eos=True)).result().ttft_s

        def decode_step(batch: int) -> float:
            params = SamplingParams(max_new_tokens=DECODE_TOKENS, ignore_eos=True)
            results = engine.generate([prompt(64) for _ in range(batch)], params)
            return statistics.median((r.latency_s - r.ttft_s) / (DECODE_TOKENS - 1) for r in results)

        ttft(64)  # the first request pays for what is built once
        short, long = (min(ttft(n) for _ in range(REPEATS)) for n in PREFILL_LENGTHS)
        one, many = (min(decode_step(b) for _ in range(REPEATS)) for b in (1, DECODE_BATCH))
    per_request = max((many - one) / (DECODE_BATCH - 1), 0.0)
    overhead = max(one - per_request, 0.0)
    n1, n2 = PREFILL_LENGTHS
    # Solve [n, n (n + 1) / 2] . (a, b) = t - overhead at both lengths.
    system = np.array([[n1, n1 * (n1 + 1) / 2], [n2, n2 * (n2 + 1) / 2]])
    a, b = np.linalg.solve(system, [short - overhead, long - overhead])
    if a <= 0 or b <= 0:
        raise UserError(f"calibration: prefill {n1} tokens {1000 * short:.1f} ms, {n2} tokens {1000 * long:.1f} ms "
                        "do not grow with the length as a step's cost does (a busy machine?); run it again")  # fmt: skip
    c = base.compute
    compute = Compute(
        flops=c.flops_per_token / a, flops_per_token=c.flops_per_token, attention_flops=c.attention_flops_per_pair / b,
        attention_flops_per_pair=c.attention_flops_per_pair, step_overhead_s=overhead,
        decode_s_per_request=per_request, memory_bandwidth=c.memory_bandwidth,
    )  # fmt: skip
    return dataclasses.replace(base, name=name, compute=compute)


def to_toml(cost: CostModel, note: str) -> str:
    """The cost model as a file `load_cost_model` reads back."""
    lines = [f"# {line}" for line in note.splitlines()]
    lines += [f'name = "{cost.name}"', f"kv_bytes_per_token = {cost.kv_bytes_per_token}"]
    for section in ("compute", "host_to_device", "device_to_host", "storage"):
        table = getattr(cost, section)
        lines += ["", f"[{section}]"] + [f"{f.name} = {getattr(table, f.name)!r}" for f in dataclasses.fields(table)]
    return "\n".join(lines) + "\n"
