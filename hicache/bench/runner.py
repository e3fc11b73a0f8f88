"""Runs a benchmark (the `bench` part of the design): for each arm, start its server (or use a given
URL), warm up, flush, optionally run a warming pass and restart the server, then measure one pass of the
workload (session.py) and summarize it. `run_bench` is the Python entry point (`hicache demo` builds
on it); what to run is a `BenchConfig` (config.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from typing import IO

import httpx

from hicache.bench.client import served_model
from hicache.bench.config import Arm, BenchConfig, serve_model
from hicache.bench.launcher import ServerProcess
from hicache.bench.metrics import summarize
from hicache.bench.pd_launcher import PDDeployment
from hicache.bench.session import ArmSession
from hicache.bench.workload import Workload, build_workload, load_tokenizer
from hicache.errors import UserError
from hicache.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _launch_flags(arm: Arm) -> tuple[str, ...]:
    """The `hicache serve` flags that name a launched arm's model (a P/D arm's prefill's)."""
    if arm.pd_args is not None:
        return arm.pd_args[0]
    assert arm.serve_args is not None
    return arm.serve_args


def _arm_model(config: BenchConfig, arm: Arm, url: str | None, transport: httpx.AsyncBaseTransport | None) -> str:
    if config.model is not None:
        return config.model
    if arm.launched:
        return serve_model(_launch_flags(arm))[1]

    async def ask() -> str:
        async with httpx.AsyncClient(base_url=url, transport=transport, timeout=30.0) as client:
            return await served_model(client)

    return asyncio.run(ask())


def _run_arm(
    config: BenchConfig,
    arm: Arm,
    workload: Workload,
    tokenizer: Tokenizer,
    transport: httpx.AsyncBaseTransport | None,
    out: IO[str] | None,
) -> dict:
    server: ServerProcess | PDDeployment | None = None
    if arm.pd_args is not None:
        server = PDDeployment(*arm.pd_args)
    elif arm.serve_args is not None:
        server = ServerProcess(arm.serve_args)
    if server is not None:
        server.start()
    moved = None
    try:
        url = server.url if server is not None else config.base_url
        assert url is not None
        model = _arm_model(config, arm, url, transport)
        session = ArmSession(config, arm, workload, tokenizer, model, transport)
        flushed = asyncio.run(session.warm_up_and_flush(url))
        if arm.warm_then_restart:
            assert isinstance(server, ServerProcess)
            asyncio.run(session.run_pass(url, measured=False, label=f"{arm.name} (warming pass)"))
            server.restart()
            url = server.url
        before = server.received_bytes() if isinstance(server, PDDeployment) else None
        records, duration = asyncio.run(session.run_pass(url, measured=True, label=arm.name))
        if isinstance(server, PDDeployment) and before is not None:
            after = server.received_bytes()
            moved = after - before if after is not None else None
    finally:
        if server is not None:
            server.stop()
    session.log.replay(tokenizer)
    mismatched = sum(1 for r in records if r.ok and r.prompt_tokens != r.prompt_tokens_client)
    if mismatched:
        logger.warning(
            "arm %s: %d requests where the server counted other prompt tokens than the benchmark's tokenizer "
            "(another chat template or tokenizer?); ideal hit rates are approximate",
            arm.name,
            mismatched,
        )
    summary = summarize(
        arm.name,
        records,
        duration,
        {
            "dataset": workload.dataset,
            "workload": workload.params,
            "num_rounds": workload.num_rounds,
            "endpoint": config.endpoint,
            "model": model,
            "serve_args": list(arm.serve_args) if arm.serve_args is not None else None,
            "pd_args": [list(flags) for flags in arm.pd_args] if arm.pd_args is not None else None,
            "kv_bytes_transferred": moved,
            "base_url": config.base_url if not arm.launched else None,
            "warm_then_restart": arm.warm_then_restart,
            "max_concurrency": config.max_concurrency,
            "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
            "warmup_requests": config.warmup_requests,
            "flushed": flushed,
        },
    )
    if out is not None:
        for record in records:
            out.write(json.dumps(record.to_json()) + "\n")
        out.write(json.dumps(summary) + "\n")
        out.flush()
    logger.info(
        "arm %s: %d ok, %d failed, hit rate %s (ideal %s)",
        arm.name,
        summary["completed"],
        summary["failed"],
        summary["hit_rate"],
        summary["ideal_hit_rate"],
    )
    return summary


def resolve_tokenizer_name(config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> str:
    if config.tokenizer is not None:
        return config.tokenizer
    if config.model is not None:
        return config.model
    first = config.arms[0]
    if first.launched:
        return serve_model(_launch_flags(first))[0]
    return _arm_model(config, first, config.base_url, transport)


def run_bench(config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> list[dict]:
    """Runs every arm of `config` on the same workload, in order; returns one summary dict per arm and,
    with `output_file`, writes each arm's request rows and summary row as it finishes. `transport`
    replaces the network (tests)."""
    tokenizer = load_tokenizer(resolve_tokenizer_name(config, transport))
    workload = build_workload(config.workload, tokenizer)
    with contextlib.ExitStack() as stack:
        out = None
        if config.output_file:
            try:
                out = stack.enter_context(open(config.output_file, "w", encoding="utf-8"))
            except OSError as exc:
                raise UserError(f"cannot write --output-file: {exc.strerror}: {config.output_file}") from None
        return [_run_arm(config, arm, workload, tokenizer, transport, out) for arm in config.arms]
