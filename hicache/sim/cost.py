"""The simulator's cost model (docs/DESIGN.md, "capacity simulator"): what a step of compute and a copy
over each link cost, read from a TOML file (presets/ holds the shipped ones).

A step costs `step_overhead_s`, plus for every token computed `flops_per_token / flops` and for every
(query, key) pair of its attention `attention_flops_per_pair / attention_flops`, plus for every decoding
request `decode_s_per_request` and its KV read at `memory_bandwidth`. A copy costs `latency_s + bytes /
bandwidth` on its link, bytes being pages x page size x `kv_bytes_per_token`; storage calls share one
link (the storage tier's one worker): an existence query costs `latency_s`, a read or a put `latency_s`
plus its bytes at `read_bandwidth` or `write_bandwidth`. A P/D pair's KV transfer costs `latency_s + bytes /
bandwidth` on `[nic]`, bytes being the suffix's tokens x `kv_bytes_per_token`.

A cost model says what it describes: `measured_on` (the CPU or GPU its figures come from), `device` (cpu or
cuda) and `dtype` (the KV and activation dtype its figures are for): the same engine flags in another
dtype move other bytes and compute at other rates, which `hicache simulate` warns of.
"""

from __future__ import annotations

import pathlib
import tomllib
from dataclasses import dataclass, fields

from hicache.errors import UserError

PRESETS = pathlib.Path(__file__).parent / "presets"
# Figures a cost divides by
POSITIVE = ("flops", "attention_flops", "memory_bandwidth", "bandwidth", "read_bandwidth", "write_bandwidth")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency_s: float


@dataclass(frozen=True)
class Storage:
    read_bandwidth: float  # bytes/s
    write_bandwidth: float  # bytes/s
    latency_s: float  # a call (an existence query, a read, a put)


@dataclass(frozen=True)
class Compute:
    flops: float  # achieved FLOP/s of the model's GEMMs
    flops_per_token: float  # 2 x non-embedding parameters
    attention_flops: float  # achieved FLOP/s of attention
    attention_flops_per_pair: float  # 4 x layers x query heads x head dim
    step_overhead_s: float
    decode_s_per_request: float
    memory_bandwidth: float  # bytes/s a decode step reads its requests' KV at


@dataclass(frozen=True)
class CostModel:
    name: str
    kv_bytes_per_token: int
    compute: Compute
    host_to_device: Link
    device_to_host: Link
    storage: Storage
    nic: Link  # a P/D pair's KV transfer, prefill to decode (hicache/sim/pd.py)
    measured_on: str = ""  # the machine its figures come from ("": the file does not say)
    device: str = "cpu"
    dtype: str = ""  # its figures' KV and activation dtype ("": the file does not say)

    def step_s(self, items: list[tuple[int, int]], decoding: list[int]) -> float:
        """A step computing tokens [start, end) of each of `items`, and one token each of requests
        holding `decoding` KV tokens."""
        c = self.compute
        tokens = sum(end - start for start, end in items) + len(decoding)
        # Query i attends to keys [0, i]: a chunk's pairs are the sum over its rows.
        pairs = sum((end - start) * (start + end + 1) / 2 for start, end in items) + sum(n + 1 for n in decoding)
        kv_read = sum(decoding) * self.kv_bytes_per_token
        gemm_s = tokens * c.flops_per_token / c.flops
        attention_s = pairs * c.attention_flops_per_pair / c.attention_flops
        decode_s = len(decoding) * c.decode_s_per_request + kv_read / c.memory_bandwidth
        return c.step_overhead_s + gemm_s + attention_s + decode_s


def load_cost_model(name_or_path: str) -> CostModel:
    """A preset's name (a file in presets/ without .toml) or a TOML file; UserError (one line) for a
    file that cannot be read or lacks a figure."""
    path = PRESETS / f"{name_or_path}.toml"
    if not path.is_file():
        path = pathlib.Path(name_or_path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.toml")))
        raise UserError(f"cannot read cost model {name_or_path}: {exc.strerror} (presets: {presets})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"cost model {path}: not TOML: {exc}") from None
    return CostModel(
        name=str(data.get("name", path.stem)),
        kv_bytes_per_token=int(_number(data, path, "kv_bytes_per_token")),
        compute=_section(Compute, data, path, "compute"),
        host_to_device=_section(Link, data, path, "host_to_device"),
        device_to_host=_section(Link, data, path, "device_to_host"),
        storage=_section(Storage, data, path, "storage"),
        nic=_section(Link, data, path, "nic"),
        measured_on=str(data.get("measured_on", "")),
        device=_choice(data, path, "device", DEVICES, "cpu"),
        dtype=_choice(data, path, "dtype", ("", *DTYPES), ""),
    )


def _choice(data: dict, path: pathlib.Path, key: str, choices: tuple[str, ...], default: str) -> str:
    value = data.get(key, default)
    if value not in choices:
        raise UserError(f"cost model {path}: {key} must be one of {', '.join(c for c in choices if c)}, got {value!r}")
    return value


def _section(cls: type, data: dict, path: pathlib.Path, name: str):  # noqa: ANN202 - an instance of cls
    table = data.get(name)
    if not isinstance(table, dict):
        raise UserError(f"cost model {path}: missing table [{name}]")
    values = {f.name: _number(table, path, f.name, name) for f in fields(cls)}
    return cls(**values)


def _number(table: dict, path: pathlib.Path, key: str, section: str = "") -> float:
    where = f"{section}.{key}" if section else key
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"cost model {path}: {where} must be a number, got {value!r}")
    if value < 0 or (value == 0 and key in POSITIVE):
        raise UserError(f"cost model {path}: {where} must be positive, got {value!r}")
    return value
