"""The defaults are the fastest exact path for the checkpoint and the CPU (docs/DESIGN.md, "the fastest path by
default"): a GGUF's quantized tensors stay quantized, on hicache's native kernels with float32 activations
wherever those are built; dense weights take bf16 only where the CPU multiplies it natively."""

from __future__ import annotations

import pytest
import torch

from hicache.config import EngineConfig
from hicache.config.cpu import CPU_BF16_ENV
from hicache.engine.build import activation_dtype
from hicache.model.loading.loader import load_model
from tests.model.test_quant import NATIVE_KERNELS

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", keep_codes=True)


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_takes_the_native_kernels_in_float32_and_bf16_only_for_dense_weights(smollm2, native_bf16, monkeypatch):
    tiny = load_model("tiny")
    monkeypatch.setenv(CPU_BF16_ENV, str(int(native_bf16)))  # resolve as that kind of CPU would
    defaults = EngineConfig()
    assert defaults.quantization == "auto" and defaults.dtype == "auto"
    dense = torch.bfloat16 if native_bf16 else torch.float32
    assert activation_dtype(defaults, tiny) == dense  # nothing quantized in tiny's checkpoint
    assert activation_dtype(EngineConfig(quantization="none"), smollm2) == dense
    # smollm2's Q4_1/Q8_0 codes: the native kernels quantize activations to 16-bit codes in any dtype
    assert activation_dtype(defaults, smollm2) == (torch.float32 if NATIVE_KERNELS else dense)
    assert activation_dtype(EngineConfig(dtype="bfloat16"), smollm2) == torch.bfloat16  # asked for: kept


def test_the_weights_kernels_are_named_with_the_isa_they_run_on(smollm2):
    """/health and the start-up line say which passes multiply the weights: the native kernels' AVX-512
    VNNI ones on a CPU that has them (AVX2's elsewhere, the same bits), aten's where no native build
    loads, and "dense" for weights not kept quantized."""
    from hicache.model.build import with_weight_format
    from hicache.model.kernels import native

    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= native._cpu_flags()
    kept = with_weight_format(smollm2, "checkpoint", CPU).extra["weight_kernels"]
    assert kept == (f"native {'avx512-vnni' if vnni else 'avx2'}" if NATIVE_KERNELS else "aten")
    assert with_weight_format(smollm2, "none", CPU).extra["weight_kernels"] == "dense"
