"""Helpers shared by the benchmark scripts: the machine's limits measured in the same run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import torch


def best_time(fn, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(dtype: torch.dtype, max_n: int = 2048, enough_s: float = 0.2) -> tuple[float, int]:
    """GFLOP/s of an n x n `F.linear` (the GEMM the model's projections run) and the n measured: n doubles
    from 256 until one product takes `enough_s` or n reaches `max_n`, so a dtype the CPU lacks a fast path
    for (bf16 on an AVX2-only CPU: under 1 GFLOP/s for `a @ b`) is measured in seconds, not minutes."""
    n = 256
    while True:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        seconds = best_time(lambda: torch.nn.functional.linear(a, b))
        if seconds >= enough_s or n >= max_n:
            return 2 * n**3 / seconds / 1e9, n
        n *= 2


def measure_in_tree(tree: str, script: str, args: list[str]):
    """Run `script --one ARGS` in a fresh interpreter importing `hicache` from `tree` (a checkout beside this
    one, for a before/after in the same run) and return the JSON its last line prints."""
    command = [sys.executable, script, "--one", *args]
    out = subprocess.run(command, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memcpy_gbps(nbytes: int = 1 << 28) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / best_time(lambda: dst.copy_(src)) / 1e9


def copy_gbps_read_write(nbytes: int = 1 << 29) -> float:
    """Memory bandwidth from a large tensor copy, counting the bytes read plus the bytes written (2n for
    a copy of n bytes): the traffic a stream of weight reads competes with. `nbytes` should dwarf the
    last-level cache."""
    return 2 * memcpy_gbps(nbytes)


def cpu_name() -> str:
    """The CPU's model name, the vector ISA /proc/cpuinfo reports and the one torch dispatches to."""
    name, flags = platform.processor() or "cpu", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = (
        "AVX512+BF16"
        if "avx512_bf16" in flags
        else "AVX512"
        if "avx512f" in flags
        else "AVX2"
        if "avx2" in flags
        else "?"
    )
    return f"{name} ({isa} in /proc/cpuinfo; torch dispatches {torch.backends.cpu.get_cpu_capability()})"
