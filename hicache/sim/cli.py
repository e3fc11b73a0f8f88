"""`hicache simulate` (docs/DESIGN.md, "capacity simulator"): a trace through the real scheduler and cache
in virtual time, costed by a cost model; prints `hicache bench`'s table for it.

    hicache simulate --model tiny --max-total-tokens 8192 --enable-hierarchical-cache \\
        --cost-model epyc-2core-tiny --dataset generated-shared-prefix --gsp-num-turns 4
    hicache simulate --cost-model h100x8-llama70b --trace mooncake.jsonl --max-total-tokens 1048576 --page-size 64
    hicache simulate --model tiny --calibrate here.toml   # then: hicache simulate --cost-model here.toml ...
    hicache simulate --model tiny --enable-hierarchical-cache \
        --pd-decode="--disaggregation-decode-enable-radix-cache --enable-hierarchical-cache" ...   # a P/D pair

The engine flags are `hicache serve`'s: they configure the simulated cache and scheduler (the model is
used only for its tokenizer, to build a generated workload's prompts and draw token ids).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import platform
import shlex
import time
from typing import TYPE_CHECKING

import torch

from hicache.bench.cli import add_workload_args, workload_from_args
from hicache.config import EngineConfig
from hicache.config.flags import add_command, add_engine_args

if TYPE_CHECKING:
    from hicache.sim.cost import CostModel

logger = logging.getLogger(__name__)


def cmd_simulate(args: argparse.Namespace) -> int:
    from hicache.bench.metrics import summarize
    from hicache.bench.report import markdown_table, per_round_table
    from hicache.bench.workload import build_workload, load_tokenizer
    from hicache.sim.cost import load_cost_model
    from hicache.sim.pd import PDSimulator
    from hicache.sim.simulator import Simulator
    from hicache.sim.trace import from_workload, read_mooncake

    cost = load_cost_model(args.cost_model)
    cfg = EngineConfig.from_args(args)
    if args.calibrate:
        return write_calibration(cfg, cost, args.calibrate)
    decode = decode_config(cfg, args.pd_decode) if args.pd_decode is not None else None
    for server in (cfg, decode) if decode else (cfg,):
        warn_of_another_dtype(server, cost)
    tokenizer = load_tokenizer(cfg.model)
    if args.trace:
        trace = read_mooncake(args.trace, tokenizer.vocab_size)
    else:
        trace = from_workload(build_workload(workload_from_args(args), tokenizer), tokenizer)
    label = args.label or cost.name
    if decode is not None:
        simulator: Simulator | PDSimulator = PDSimulator(cfg, decode, cost, label=label)
        servers = {"prefill": simulator.prefill, "decode": simulator.decode}
    else:
        simulator = Simulator(cfg, cost, label=label)
        servers = {"": simulator}
    started = time.perf_counter()
    try:
        records = simulator.run(trace)
    finally:
        simulator.shutdown()
    wall_s = time.perf_counter() - started
    virtual_s = max(server.clock.now for server in servers.values())
    extra = {"kv_bytes_transferred": simulator.kv_link.bytes_moved} if isinstance(simulator, PDSimulator) else {}
    summary = summarize(simulator.label, records, virtual_s, extra)
    print(markdown_table([summary]))
    print()
    print(per_round_table([summary]))
    print()
    print(bytes_table(simulator.bytes_moved()))
    for name, server in servers.items():
        print(f"\n{name} server:" if name else "")
        print(occupancy_table(server.occupancy))
    if isinstance(simulator, PDSimulator):
        prefix = simulator.decode_prefix_by_tier
        print(f"\ndecode's own prefix (not transferred): {sum(prefix.values()):,} tokens "
              f"({', '.join(f'{tier} {n:,}' for tier, n in prefix.items())})")  # fmt: skip
    print(f"\n{len(records)} requests, {virtual_s:.2f} s of virtual time simulated in {wall_s:.1f} s")
    return 0


def decode_config(prefill: EngineConfig, decode_flags: str) -> EngineConfig:
    """The decode server of a P/D pair: `decode_flags` (`hicache serve`'s flags), the prefill server's model
    unless they name one."""
    parser = argparse.ArgumentParser(prog="hicache simulate --pd-decode", add_help=False)
    add_engine_args(parser)
    # The role last: no flag may change it, and decode's own flags are valid only with it.
    flags = ["--model", prefill.model, *shlex.split(decode_flags), "--disaggregation-mode", "decode"]
    return EngineConfig.from_args(parser.parse_args(flags))


def engine_dtype(cfg: EngineConfig, device: str) -> str:
    """The dtype an engine of `cfg` runs, on `device` (a cost model's) where `--device` is auto: `--dtype` as
    the engine resolves it (on a CPU, `auto` by this CPU and the checkpoint's weights, `activation_dtype`:
    only then is the checkpoint read)."""
    from hicache.engine.build import activation_dtype
    from hicache.model.loading.loader import load_model

    if cfg.device == "auto" and device == "cpu":
        cfg = dataclasses.replace(cfg, device="cpu")
    if cfg.dtype != "auto" or cfg.device == "auto":  # the latter: a GPU's, which this machine need not have
        dtype = cfg.resolved_dtype(torch.device(device))
    else:
        dtype = activation_dtype(cfg, load_model(cfg.model, keep_codes=cfg.quantization != "none"))
    return str(dtype).removeprefix("torch.")


def warn_of_another_dtype(cfg: EngineConfig, cost: CostModel) -> None:
    """One line when the server `cfg` configures would run another dtype than the one `cost`'s figures
    are for (on the cost model's device, unless `--device` names one): the simulation charges that
    dtype's KV bytes and compute rates, not this server's."""
    if not cost.dtype:
        return
    dtype = engine_dtype(cfg, cost.device)
    if dtype != cost.dtype:
        device = cfg.device if cfg.device != "auto" else cost.device
        where = "this CPU" if device == "cpu" else device
        logger.warning("cost model %s is for %s (%s), but these engine flags run %s on %s: its KV bytes and compute "
                       "figures are not this server's (pass --dtype %s, or measure a cost model with --calibrate)",
                       cost.name, cost.dtype, cost.measured_on, dtype, where, cost.dtype)  # fmt: skip


def write_calibration(cfg: EngineConfig, base, path: str) -> int:
    from hicache.sim.calibrate import calibrate, to_toml

    cost = calibrate(cfg, base, pathlib.Path(path).stem)
    note = (f"Measured by `hicache simulate --calibrate` on {platform.node()} ({os.cpu_count()} CPUs), "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},\nfor --model {cfg.model}; "
            f"the model's constants, links and storage are {base.name}'s.")  # fmt: skip
    pathlib.Path(path).write_text(to_toml(cost, note), encoding="utf-8")
    c = cost.compute
    print(f"wrote {path}: step {1000 * c.step_overhead_s:.2f} ms + {1000 * c.decode_s_per_request:.3f} ms a decoding "
          f"request, GEMMs {c.flops / 1e9:.1f} GFLOP/s, attention {c.attention_flops / 1e9:.1f} GFLOP/s")  # fmt: skip
    return 0


def bytes_table(moved: dict[str, int]) -> str:
    lines = ["| link | bytes moved |", "| --- | ---: |"]
    lines += [f"| {link} | {nbytes / 2**20:.1f} MiB |" for link, nbytes in moved.items()]
    return "\n".join(lines)


def occupancy_table(occupancy: list[tuple[float, dict[str, int]]]) -> str:
    """Each tier's peak and mean (over virtual time) tokens held, cached or in use."""
    lines = ["| tier | peak tokens held | time-weighted mean |", "| --- | ---: | ---: |"]
    if len(occupancy) < 2:
        return "\n".join(lines)
    span = occupancy[-1][0] - occupancy[0][0]
    for tier in occupancy[-1][1]:
        held = [used.get(tier, 0) for _, used in occupancy]
        # Each sample holds until the next one.
        area = sum(n * (t1 - t0) for n, (t0, _), (t1, _) in zip(held, occupancy, occupancy[1:]))
        lines.append(f"| {tier} | {max(held):,} | {area / span:,.0f} |")
    return "\n".join(lines)


def add_simulate_command(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "simulate", "replay a trace through the real cache in virtual time, costed by a cost model", __doc__
    )
    add_engine_args(p)
    sim = p.add_argument_group("simulation")
    sim.add_argument("--cost-model", default="epyc-2core-tiny",
                     help="a preset (epyc-2core-tiny, h100x8-llama70b) or a TOML file")  # fmt: skip
    sim.add_argument("--trace", help="a Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids) "
                     "instead of a generated workload")  # fmt: skip
    sim.add_argument(
        "--calibrate",
        metavar="TOML",
        help="measure this machine's compute figures by running the "
        "real engine briefly (the --cost-model preset gives the rest) and write them as a cost model",
    )
    sim.add_argument("--pd-decode", metavar="FLAGS", help="simulate a P/D pair: this command's engine flags are the "
                     "prefill server's, FLAGS the decode server's (`hicache serve` flags: --pd-decode=\"--flag ...\"); "
                     "each gets its --disaggregation-mode; the KV transfer is costed on the cost model's "
                     "[nic]")  # fmt: skip
    sim.add_argument("--label", help="the run's name in the table (default: the cost model's)")
    add_workload_args(p)
    p.set_defaults(func=cmd_simulate)
