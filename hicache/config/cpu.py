"""Whether this CPU multiplies bf16 natively, the question `--dtype auto` asks on a CPU (docs/DESIGN.md,
"configuration, CLI flags"). `HICACHE_CPU_BF16=1` answers as a CPU with native bf16 would, `=0` as an
AVX2-only one, whatever this CPU is; unset (or empty), the CPU is asked. It exists so that a test suite
passing on one kind of CPU can be run as the other kind resolves `auto` (`make test`'s second pass,
docs/DESIGN.md, "Conventions"); it changes which dtype `auto` picks, never what a dtype computes."""

from __future__ import annotations

import os

import torch

from hicache.errors import UserError

CPU_BF16_ENV = "HICACHE_CPU_BF16"


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 beats fp32; as
    `HICACHE_CPU_BF16` says, where it is set."""
    forced = os.environ.get(CPU_BF16_ENV, "")
    if forced:
        if forced not in ("0", "1"):
            raise UserError(f"{CPU_BF16_ENV} must be 1 (resolve --dtype auto as a CPU with native bf16), "
                            f"0 (as one without) or unset (ask this CPU), got {forced!r}")  # fmt: skip
        return forced == "1"
    return detected_native_bf16()


def detected_native_bf16() -> bool:
    """What this CPU itself says: an AVX512 build of torch's kernels and the avx512_bf16 or amx_bf16 flag."""
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return capability.startswith("AVX512") and ("avx512_bf16" in flags or "amx_bf16" in flags)


def describe_cpu() -> str:
    """This CPU in a line, as a measurement records the machine it ran on: its model name, the widest
    kernels torch runs on it, whether it multiplies bf16 natively, and its CPU count."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    bf16 = "native bf16" if detected_native_bf16() else "no native bf16"
    return f"{model} ({torch.backends.cpu.get_cpu_capability()}, {bf16}), {os.cpu_count()} CPUs"
