"""Benchmark configuration (the `bench` part of the design): the arms to measure (`hicache serve` flags
for a fresh server, or a given URL) and one `BenchConfig` for a whole run, validated when built, so the
CLI, the demo and Python callers get the same checks.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.bench.client import ENDPOINTS
from hicache.bench.launcher import check_serve_args
from hicache.bench.workload import GSPParams, MultiRoundParams
from hicache.errors import UserError


@dataclass(frozen=True)
class Arm:
    """One configuration to measure. `serve_args` are `hicache serve` flags for a fresh server; None
    targets `BenchConfig.base_url`. With `warm_then_restart`, the workload runs once, the server is
    restarted with the same flags (nothing flushed), and the second pass is measured: what it hits
    beyond a cold pass survived the restart (the storage tier)."""

    name: str
    serve_args: tuple[str, ...] | None = None
    warm_then_restart: bool = False
    pd_args: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # prefill and decode flags (--launch-pd)

    def __post_init__(self) -> None:
        if self.serve_args is not None:
            object.__setattr__(self, "serve_args", tuple(self.serve_args))  # a list is fine too
            check_serve_args(self.serve_args)
        if self.pd_args is not None:
            prefill, decode = (tuple(flags) for flags in self.pd_args)
            object.__setattr__(self, "pd_args", (prefill, decode))
            for flags in (prefill, decode):
                check_serve_args(flags)
                if any(f.startswith("--disaggregation-mode") for f in flags):
                    raise UserError("--launch-pd chooses --disaggregation-mode itself; leave it out")
            if self.serve_args is not None or self.warm_then_restart:
                raise UserError(f"arm {self.name!r}: a P/D arm has no single server's flags to restart")

    @property
    def launched(self) -> bool:
        return self.serve_args is not None or self.pd_args is not None


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: a workload run on every arm in turn. Field names follow the CLI flags."""

    workload: GSPParams | MultiRoundParams
    arms: tuple[Arm, ...]
    base_url: str | None = None
    endpoint: str = "completions"
    model: str | None = None  # the requests' "model"; defaults to the arm's --model or GET /v1/models
    tokenizer: str | None = None  # defaults to the model
    max_concurrency: int | None = None  # None: every conversation at once
    request_rate: float = math.inf
    flush_cache: bool = False
    warmup_requests: int = 1
    # Exact output lengths need the server to ignore EOS; every common open server accepts this field.
    extra_body: dict[str, Any] = field(default_factory=lambda: {"ignore_eos": True})
    output_file: str | None = None
    request_timeout_s: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.arms:
            raise UserError("a benchmark needs at least one arm")
        names = [arm.name for arm in self.arms]
        if len(set(names)) != len(names):
            raise UserError(f"arm names must be unique, got {names}")
        for arm in self.arms:
            if not arm.launched and self.base_url is None:
                raise UserError(f"arm {arm.name!r} has no serve flags and there is no --base-url")
            if not arm.launched and arm.warm_then_restart:
                raise UserError(f"arm {arm.name!r}: warm-then-restart needs a launched server, not --base-url")
        if self.endpoint not in ENDPOINTS:
            raise UserError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise UserError(f"--max-concurrency must be positive, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise UserError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if self.warmup_requests < 0:
            raise UserError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")
        if self.request_timeout_s <= 0:
            raise UserError(f"--request-timeout must be positive, got {self.request_timeout_s}")


def serve_model(serve_args: Sequence[str]) -> tuple[str, str]:
    """(model, served name) of a `hicache serve` command line: `--model` (the engine's default when
    absent) loads the tokenizer, `--served-model-name` (default: the model) goes into requests."""
    from hicache.config import EngineConfig

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", "--model-path", dest="model", default=EngineConfig().model)
    parser.add_argument("--served-model-name", default=None)
    known = parser.parse_known_args(list(serve_args))[0]
    return known.model, known.served_model_name or known.model

