"""Helpers shared by the benchmark scripts: the machine's limits measured in the same run."""

from __future__ import annotations

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


def matmul_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: a @ b) / 1e9


def memcpy_gbps(nbytes: int = 1 << 28) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / best_time(lambda: dst.copy_(src)) / 1e9
