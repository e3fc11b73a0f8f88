"""`HICACHE_CPU_BF16` (hicache/config/cpu.py): `--dtype auto` resolves as on a CPU with native bf16 (1) or an
AVX2-only one (0) whatever this CPU is, so the suite runs as either kind would (`make test`'s second pass);
unset or empty, the CPU is asked; any other value is one line and exit 2."""

from __future__ import annotations

import pytest
import torch

from hicache.cli import main
from hicache.config import EngineConfig
from hicache.config.cpu import CPU_BF16_ENV, cpu_has_native_bf16, describe_cpu, detected_native_bf16
from hicache.engine.build import activation_dtype
from hicache.errors import UserError
from hicache.model.loading.loader import load_model

CPU = torch.device("cpu")


@pytest.mark.parametrize(("value", "dense"), [("1", torch.bfloat16), ("0", torch.float32)])
def test_the_variable_resolves_auto_as_the_other_kind_of_cpu_would(monkeypatch, value, dense):
    monkeypatch.setenv(CPU_BF16_ENV, value)
    assert cpu_has_native_bf16() is (value == "1")
    assert EngineConfig(device="cpu").resolved_dtype() == dense
    assert activation_dtype(EngineConfig(device="cpu"), load_model("tiny")) == dense  # dense weights follow it
    for asked in ("float32", "bfloat16"):  # a dtype asked for is kept on either kind
        assert EngineConfig(device="cpu", dtype=asked).resolved_dtype() == getattr(torch, asked)
    assert EngineConfig(device="cpu").resolved_dtype(torch.device("cuda")) == torch.bfloat16  # not a CPU's choice


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_asks_this_cpu(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_BF16_ENV, value)
    assert cpu_has_native_bf16() is detected_native_bf16()
    assert ("no native bf16" in describe_cpu()) is not detected_native_bf16()


def test_another_value_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(UserError, match=f"{CPU_BF16_ENV} must be 1 .* or unset"):
        cpu_has_native_bf16()
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and CPU_BF16_ENV in err and "'yes'" in err, err
