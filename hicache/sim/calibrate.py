"""`hicache simulate --calibrate` (docs/DESIGN.md, "capacity simulator"): a cost model measured on this
machine by running the real engine briefly, written as TOML.

Measured, with the device cache alone: the time to first token of new prompts of two lengths and of
an extension (`EXTENSION` new tokens after the longer prompt, which the tree holds: the shape of a
cache hit), and a decode step at batch 1 and at batch `DECODE_BATCH`, each the fastest of `REPEATS` (on
a shared machine the least disturbed). Fitted to cost.py's step cost: the decode steps give the fixed
cost a step and the cost a decoding request; the three prefills, less that fixed cost, give the GEMM
cost a token a and the attention cost a (query, key) pair b (t = a tokens + b pairs, least relative
squares: the kernels do not spend exactly the same a pair on a new prompt's triangle as on a hit's
rectangle), hence `flops` and `attention_flops` from the base preset's FLOPs a token and a pair.
The model's constants, the links and storage are the base preset's (a model's, not a machine's, or
measured by benchmarks/hicache_bench.py and storage_bench.py); the KV bytes a token are the base's in the
dtype the engine ran here, and the cost model names this machine and that dtype.
"""

from __future__ import annotations

import dataclasses
import json
import statistics

import numpy as np
import torch

from hicache.config import EngineConfig
from hicache.config.cpu import describe_cpu
from hicache.engine.engine import Engine
from hicache.errors import UserError
from hicache.scheduler.request import SamplingParams
from hicache.sim.cost import Compute, CostModel

PREFILL_LENGTHS = (512, 2048)
REPEATS = 5
EXTENSION = 256
DECODE_TOKENS = 16
DECODE_BATCH = 8


def calibrate(cfg: EngineConfig, base: CostModel, name: str) -> CostModel:
    """`base` with its compute figures measured on this machine for `cfg`'s model."""

    measured = dataclasses.replace(cfg, disable_radix_cache=False, hicache=dataclasses.replace(cfg.hicache,
                                   enable_hierarchical_cache=False, hicache_storage_backend=None))  # fmt: skip
    rng = np.random.default_rng(0)
    with Engine(measured) as engine:
        vocab, dtype, device = engine.tokenizer.vocab_size, engine.config.dtype, engine.config.resolved_device()

        def prompt(n: int) -> list[int]:
            return rng.integers(0, vocab, n).tolist()

        def ttft(tokens: list[int]) -> float:
            return engine.submit(tokens, SamplingParams(max_new_tokens=1, ignore_eos=True)).result().ttft_s

        def extension() -> float:
            cached = prompt(PREFILL_LENGTHS[-1])
            ttft(cached)
            return ttft(cached + prompt(EXTENSION))

        def decode_step(batch: int) -> float:
            params = SamplingParams(max_new_tokens=DECODE_TOKENS, ignore_eos=True)
            results = engine.generate([prompt(64) for _ in range(batch)], params)
            return statistics.median((r.latency_s - r.ttft_s) / (DECODE_TOKENS - 1) for r in results)

        ttft(prompt(PREFILL_LENGTHS[-1]))  # the first long request pays for what is built once
        # Rounds of every shape, so a burst of load on a shared machine slows one round, not one shape.
        rounds = [[ttft(prompt(n)) for n in PREFILL_LENGTHS] + [extension()] for _ in range(REPEATS)]
        prefills = [min(column) for column in zip(*rounds)]
        one, many = (min(decode_step(b) for _ in range(REPEATS)) for b in (1, DECODE_BATCH))
    per_request = max((many - one) / (DECODE_BATCH - 1), 0.0)
    overhead = max(one - per_request, 0.0)
    n = PREFILL_LENGTHS[-1]
    # (tokens, (query, key) pairs) of each prefill: query i of a chunk from `start` attends to keys [0, i].
    shapes = [(k, k * (k + 1) / 2) for k in PREFILL_LENGTHS] + [(EXTENSION, EXTENSION * (2 * n + EXTENSION + 1) / 2)]
    times = np.array(prefills)
    # Least squares relative to each time, so the short prompt counts as much as the long ones.
    (a, b), *_ = np.linalg.lstsq(np.array(shapes) / times[:, None], (times - overhead) / times, rcond=None)
    if a <= 0 or b <= 0:
        measured_ms = ", ".join(f"{1000 * t:.1f} ms" for t in prefills)
        raise UserError(f"calibration: prefills of {PREFILL_LENGTHS} tokens and {EXTENSION} after {n} took "
                        f"{measured_ms}: not a cost growing with tokens and pairs (a busy machine?); "
                        "run it again")  # fmt: skip
    c = base.compute
    compute = Compute(
        flops=float(c.flops_per_token / a), flops_per_token=c.flops_per_token,
        attention_flops=float(c.attention_flops_per_pair / b), attention_flops_per_pair=c.attention_flops_per_pair,
        step_overhead_s=overhead,
        decode_s_per_request=per_request, memory_bandwidth=c.memory_bandwidth,
    )  # fmt: skip
    # The base's KV bytes a token are its model's in its dtype: in the dtype measured here, as many elements.
    kv_bytes = base.kv_bytes_per_token * _itemsize(dtype) // _itemsize(base.dtype or dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else describe_cpu()
    return dataclasses.replace(base, name=name, compute=compute, kv_bytes_per_token=kv_bytes, measured_on=where,
                               device=device.type, dtype=dtype)  # fmt: skip


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def to_toml(cost: CostModel, note: str) -> str:
    """The cost model as a file `load_cost_model` reads back."""
    lines = [f"# {line}" for line in note.splitlines()]
    lines += [f'name = "{cost.name}"', f"measured_on = {json.dumps(cost.measured_on)}", f'device = "{cost.device}"',
              f'dtype = "{cost.dtype}"', f"kv_bytes_per_token = {cost.kv_bytes_per_token}"]  # fmt: skip
    for section in ("compute", "host_to_device", "device_to_host", "storage", "nic"):
        table = getattr(cost, section)
        lines += ["", f"[{section}]"] + [f"{f.name} = {getattr(table, f.name)!r}" for f in dataclasses.fields(table)]
    return "\n".join(lines) + "\n"
