"""hicache's native kernels: the weight-only quantized GEMMs of csrc/qgemm.cpp, the key-block attention
of csrc/attention.cpp and the per-row ops of csrc/rowops.cpp (RMSNorm, SiLU times up, RoPE), compiled with the system C++ compiler through torch's cpp_extension and loaded as
torch ops (`torch.ops.<LIBRARY>`).

`make setup` builds them once (`python -m hicache.model.kernels.native --build`); an engine that finds no
build compiles it on first use. A machine without AVX2 + FMA, a compiler or ninja gets one warning and
the aten kernels instead: the native kernels are a speed-up, never a requirement. A build has one folder
per kernel VERSION and torch build (`build_dir`), so an upgrade of either builds afresh instead of
loading a stale library; within one, torch rebuilds when the source or the flags change.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import logging
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from hicache.model.kernels import quant
from hicache.model.kernels.cache_dir import default_cache_dir

logger = logging.getLogger(__name__)

# Bump on any change of csrc/qgemm.cpp's arithmetic: the version names the library and enters the
# calibration's platform fingerprint, so plans and builds of another version are never reused.
VERSION = 2
# Bump on any change of csrc/attention.cpp's arithmetic: it names the library and enters every model's
# identity on a CPU (`attention_family`), so KV attended otherwise is never shared or paired with.
ATTENTION_VERSION = 2
# Bump on any change of csrc/rowops.cpp's own arithmetic (RMSNorm, SiLU): like the attention's, it enters
# every model's identity on a CPU (`attention_family`).
ROW_OPS_VERSION = 1
LIBRARY = f"hicache_qgemm_v{VERSION}_attention_v{ATTENTION_VERSION}_rows_v{ROW_OPS_VERSION}"
SOURCE = pathlib.Path(__file__).parent / "csrc" / "qgemm.cpp"
SOURCES = tuple(SOURCE.parent / name for name in ("qgemm.cpp", "attention.cpp", "rowops.cpp", "layer.cpp", "threads.cpp"))
# -ffp-contract=off: a multiply and an add stay two roundings (the dequantization is bitwise quant.py's).
# -fopenmp: at::parallel_for's OpenMP pragma is compiled into the caller; without it every kernel runs on
# one thread (csrc/threads.cpp). The library links libgomp.so.1, which resolves to torch's own copy.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", f"-DHICACHE_QGEMM_LIBRARY={LIBRARY}"]
LDFLAGS = ["-fopenmp"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")  # f16c: int4 scales stored as float16 (every AVX2 CPU has it)
PANEL = 8  # output rows the kernel stores together (csrc/qgemm.cpp)
STEPS = quant.INT4_GROUP // 4  # 4-input steps a group of 32 inputs (csrc/qgemm.cpp)
ACTIVATION_CODE_MAX = 127 * 255  # activation codes 255 h + l, both halves int8 in [-127, 127] (csrc/qgemm.cpp)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_dir() -> pathlib.Path:
    """Beside the source in a clone or an editable install (so a test or a user that points the plan
    cache elsewhere does not compile again), else under the kernels' cache directory."""
    name = f"{LIBRARY}-torch{torch.__version__}"
    return SOURCE.parent / "build" / name if os.access(SOURCE.parent, os.W_OK) else default_cache_dir() / "native" / name


def build(verbose: bool = False) -> None:
    """Compiles (when its sources or flags changed) and loads the library; raises on any failure."""
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(missing)}")
    # torch's build runs `ninja` from PATH; the `ninja` package puts it beside this interpreter, which
    # a PATH without the venv's bin (a service, `.venv/bin/python` called directly) does not list.
    here = os.path.dirname(sys.executable)
    if here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(p for p in (os.environ.get("PATH"), here) if p)
    from torch.utils import cpp_extension  # imported late: it is slow to import and only needed here

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _builders_lock(directory):
        cpp_extension.load(name=LIBRARY, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                           extra_ldflags=LDFLAGS, build_directory=str(directory), is_python_module=False,
                           verbose=verbose)  # fmt: skip


@contextlib.contextmanager
def _builders_lock(directory: pathlib.Path) -> Iterator[None]:
    """One build at a time in `directory`, under a lock the kernel drops with its holder. torch's own
    (its `lock` file) outlives a build killed midway, and every later load then waits on it forever;
    holding this one, no other build of ours is running, so a `lock` file found is such a leftover."""
    with open(directory / "hicache-build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if (leftover := directory / "lock").exists():
            logger.warning("removing %s, left by a build that was killed", leftover)
            leftover.unlink(missing_ok=True)
        yield


@functools.cache
def library() -> Any:
    """The loaded ops (`int8_linear`, `int4_linear`, their `_sum`s, `quantize_activations`, `block_attend`,
    `combine_blocks`, `rms_norm`, `silu_mul`, `rope`, `layer_tail`, `parallel_threads`), built first if needed; None (after
    one warning) where they cannot be built here."""
    try:
        build()
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the aten kernels"
        logger.warning("native quantized kernels unavailable (%s); using aten's packed kernels instead",
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)  # fmt: skip
        return None
    return getattr(torch.ops, LIBRARY)


# ---- the kernel's operands (csrc/qgemm.cpp's header) -------------------------------------------------


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' first stage, bitwise (csrc/qgemm.cpp's header): rows of x [M, K] float32 in groups of 32
    inputs as 16-bit codes Q = 255 high + low, the halves int8 [M, K], with a scale e = max |x| / 32385
    and s = e * sum(Q) [M, K/32]: x = e Q to 2^-16 of the group's largest input."""
    m, k = x.shape
    groups = x.float().view(m, k // quant.INT4_GROUP, quant.INT4_GROUP)
    e = groups.abs().amax(-1) / ACTIVATION_CODE_MAX
    inverse = torch.where(e >= torch.finfo(torch.float32).tiny, torch.ones_like(e) / e, torch.zeros_like(e))
    codes = torch.round(groups * inverse[..., None]).clamp(-ACTIVATION_CODE_MAX, ACTIVATION_CODE_MAX)
    high = torch.round(codes / 255)
    low = codes - 255 * high  # integers below 2^15: exact in float32, as are their sums over 32
    return high.to(torch.int8).view(m, k), low.to(torch.int8).view(m, k), e, e * codes.sum(-1)


def int8_operands(weight: quant.QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_linear's weight operands: codes in panels of 4-input steps, and the float32 scale of each
    output row."""
    return _steps(weight.codes), weight.scale[:, 0].float().contiguous()


def int4_operands(weight: quant.QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_linear's: codes in panels of 4-input steps, two steps to a byte (step 2t in the low nibbles
    of chunk t, 2t + 1 in the high), and a scale and offset per group, in panels: float16 where every one
    is a float16 (a GGUF Q4_1's: the same values, which the kernel widens exactly, at 5/6 of a one-row
    call's bytes), else float32."""
    steps = _steps(weight.codes).to(torch.uint8)
    pairs = steps.view(*steps.shape[:2], STEPS // 2, 2, 4 * PANEL)
    packed = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).contiguous()
    assert weight.offset is not None  # the int4 format is asymmetric
    scale, offset = weight.scale.float(), weight.offset.float()
    if _is_half(scale) and _is_half(offset):
        scale, offset = scale.half(), offset.half()
    return packed, _panels(scale), _panels(offset)


def _is_half(t: torch.Tensor) -> bool:
    return torch.equal(t.half().float(), t)  # an overflow (inf) or a NaN compares unequal: float32 kept


def _steps(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] -> [N/8, K/32, 8, 32]: panel, group, 4-input step, and byte 4 r + i holding output
    row r's code for input 4 step + i of the group (one broadcast of 4 inputs meets 8 outputs)."""
    n, k = codes.shape
    rows = codes.reshape(n // PANEL, PANEL, k // quant.INT4_GROUP, STEPS, 4)
    return rows.permute(0, 2, 3, 1, 4).reshape(n // PANEL, k // quant.INT4_GROUP, STEPS, 4 * PANEL).contiguous()


def _panels(per_group: torch.Tensor) -> torch.Tensor:
    """[N, G] per output row and group -> [N/8, G, 8]: a panel's 8 values of one group side by side."""
    return per_group.reshape(per_group.shape[0] // PANEL, PANEL, -1).transpose(1, 2).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="compile the native kernels now (make setup)")
    args = parser.parse_args()
    if args.build:
        start = time.perf_counter()
        try:
            build(verbose=False)
        except Exception as exc:  # noqa: BLE001 - reported, and the engine falls back at run time
            print(f"native kernels not built ({exc}); the engine will use aten's kernels", file=sys.stderr)
            return
        print(f"native kernels {LIBRARY} ready in {build_dir()} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
