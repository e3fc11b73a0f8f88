"""`hicache demo`: the README's main job. One multi-turn, shared-prefix workload (the benchmark's
generated-shared-prefix dataset) run through four cache configurations, each on its own `hicache serve`:

1. `no-cache`: `--disable-radix-cache`, every prompt computed in full;
2. `device`: the radix cache with a device KV pool smaller than the working set of all conversations;
3. `device+host`: the same device pool plus the host tier (`--enable-hierarchical-cache`), large enough
   to hold every conversation;
4. `+storage after restart`: device + host + a file store; the workload runs once, the server restarts (every
   device and host page gone), and the second pass is measured: what it reuses came from storage.

Why the device-only arm misses: every conversation sends its next turn as soon as its answer arrives, so
all of them want their history resident at once. With a pool of ~60% of that working set, the scheduler
can run only some conversations; the waiting ones' histories are the least recently used pages and are
evicted to make room, and each of their next turns recomputes its whole history. The host tier keeps
those pages and loads them back at memory speed instead.

Every arm gets the same device pool, so the table compares configurations of one amount of accelerator
memory. It is printed with ratios against the first arm, and `--out` receives the rows (demo.jsonl), a
report (report.md) and the benchmark's plots. The work is done by `hicache.bench.run_bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import pathlib
import shlex
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace

from hicache.bench import Arm, BenchConfig, GSPParams
from hicache.config.flags import add_command, add_engine_args
from hicache.errors import UserError
from hicache.storage import registry

DEFAULT_OUT = "hicache-demo"

# Sized to finish in about two and a half minutes on a 2-core CPU with smollm2 (see docs/BENCHMARKS.md, section 3):
# a history of ~800-900 tokens makes a miss cost seconds of prefill, and short answers keep decoding
# (about 0.1 s a step on that CPU) from hiding the difference in time to first token.
FULL = GSPParams(num_groups=3, prompts_per_group=2, system_prompt_len=768, question_len=24, output_len=4, num_turns=4)
# For tests and a first look; the system prompt stays above the default storage prefetch threshold (256
# tokens), so the restarted arm still reads from storage.
QUICK = GSPParams(num_groups=2, prompts_per_group=2, system_prompt_len=320, question_len=16, output_len=4, num_turns=3)

# Chat-template tokens per turn around a question and its answer (smollm2 ~10; the byte-level `tiny`
# ~20): only used to estimate the working set, generously, before any tokenizer is loaded.
TEMPLATE_TOKENS_PER_TURN = 24
# The device pool as a fraction of the working set: small enough that conversations must take turns
# on the device, large enough that a few run side by side.
DEVICE_FRACTION = 0.6
# The host tier holds the working set with this much room to spare (its pages are never evicted).
HOST_HEADROOM = 1.5
DEFAULT_HICACHE_RATIO = 2.0  # the engine's own default, kept as a floor

# Flags that define the arms; the demo sets them itself.
ARM_FLAGS = ("disable_radix_cache", "enable_hierarchical_cache", "hicache_storage_backend")
# Unless --hicache-storage-prefetch-policy says otherwise, a request whose prefix is in storage waits for
# the read: on a busy engine, `best_effort` (the engine's default) admits it at once with whatever few
# pages were read by then, and recomputes the rest.
STORAGE_PREFETCH_POLICY = "wait_complete"

# No commas: `hicache bench --arm-names` splits on them.
ARM_NAMES = ("no-cache", "device", "device+host", "+storage after restart")
GSP_FLAGS = {
    "num_groups": "--gsp-num-groups",
    "prompts_per_group": "--gsp-prompts-per-group",
    "system_prompt_len": "--gsp-system-prompt-len",
    "question_len": "--gsp-question-len",
    "output_len": "--gsp-output-len",
    "num_turns": "--gsp-num-turns",
    "seed": "--seed",
}


def workload_from_args(args: argparse.Namespace) -> GSPParams:
    """The preset (`--quick` or the full one) with any `--gsp-*` / `--seed` flag given on top."""
    preset = QUICK if args.quick else FULL
    overrides = {name: getattr(args, name) for name in GSP_FLAGS if getattr(args, name) is not None}
    return replace(preset, **overrides)


def working_set_tokens(workload: GSPParams) -> int:
    """Estimated KV tokens of every conversation at its last turn: one system prompt per group plus each
    conversation's own questions and answers (upper bound: lengths are sampled at most at their flag)."""
    per_turn = workload.question_len + workload.output_len + TEMPLATE_TOKENS_PER_TURN
    conversations = workload.num_groups * workload.prompts_per_group
    system = workload.num_groups * (workload.system_prompt_len + TEMPLATE_TOKENS_PER_TURN)
    return system + conversations * workload.num_turns * per_turn


def largest_request_tokens(workload: GSPParams) -> int:
    """Estimated prompt + output tokens of a conversation's last turn: the device pool must hold one."""
    per_turn = workload.question_len + workload.output_len + TEMPLATE_TOKENS_PER_TURN
    return workload.system_prompt_len + TEMPLATE_TOKENS_PER_TURN + workload.num_turns * per_turn


def device_pool_tokens(workload: GSPParams, page_size: int) -> int:
    """DEVICE_FRACTION of the working set in whole pages, but room for the largest request and a half."""
    tokens = max(DEVICE_FRACTION * working_set_tokens(workload), 1.5 * largest_request_tokens(workload))
    return max(page_size, int(tokens) // page_size * page_size)


def host_ratio(workload: GSPParams, device_tokens: int) -> float:
    """A host tier (as a multiple of the device pool) that holds the whole working set with headroom."""
    needed = HOST_HEADROOM * working_set_tokens(workload) / device_tokens
    return max(DEFAULT_HICACHE_RATIO, math.ceil(needed * 4) / 4)  # in quarters: readable in the flags


def forwarded_engine_flags(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`hicache serve` flags for every engine flag given with a non-default value (--dtype, --page-size,
    --hicache-write-policy, ...), so the arms run the engine the user asked for: (for every arm, for the
    arm with a store only: the storage backend's flags, which an arm without one refuses). `--model`, the
    pool sizes and the storage directory and policy are the demo's own; the arm-defining flags are
    refused."""
    scratch = argparse.ArgumentParser(add_help=False)
    add_engine_args(scratch)
    own = {"model", "max_total_tokens", "hicache_ratio", "hicache_storage_dir", "hicache_storage_prefetch_policy"}
    backend = {"hicache_storage_backend_extra_config"}
    backend |= {registry.FLAG_PREFIX + option for b in registry.BACKENDS.values() for option in b.reads}
    flags: list[str] = []
    storage: list[str] = []
    for action in scratch._actions:
        if not action.option_strings or action.dest in own:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if action.dest in ARM_FLAGS:
            raise UserError(f"{flag}: the demo sets it per arm; use `hicache bench` to choose arms yourself")
        given = [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
        if action.dest in backend:
            storage += given
        else:
            flags += given
    return flags, storage


def build_arms(
    model: str, engine_flags: list[str], device_tokens: int, ratio: float, storage_dir: str, prefetch_policy: str,
    storage_flags: Sequence[str] = (),
) -> tuple[Arm, ...]:
    """The four arms, in the order the table shows them; the first is the baseline of its ratios.
    `storage_flags`: the storage backend's, for the arm with a store only."""
    base = ("--model", model, "--max-total-tokens", str(device_tokens), *engine_flags)
    host = (*base, "--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:g}")
    storage = (
        *host,
        "--hicache-storage-backend", "file",
        "--hicache-storage-dir", storage_dir,
        "--hicache-storage-prefetch-policy", prefetch_policy,
        *storage_flags,
    )  # fmt: skip
    no_cache, device, device_host, restarted = ARM_NAMES
    return (
        Arm(no_cache, (*base, "--disable-radix-cache")),
        Arm(device, base),
        Arm(device_host, host),
        Arm(restarted, storage, warm_then_restart=True),
    )


def bench_command(workload: GSPParams, arms: tuple[Arm, ...], out_file: str) -> str:
    """The `hicache bench` command line that measures the same arms (for a larger run, change the sizes)."""
    parts = ["hicache", "bench"]
    for name, flag in GSP_FLAGS.items():
        parts += [flag, str(getattr(workload, name))]
    for arm in arms:
        parts += ["--launch-warm" if arm.warm_then_restart else "--launch", shlex.join(arm.serve_args or ())]
    parts += ["--arm-names", ",".join(arm.name for arm in arms), "--flush-cache", "--output-file", out_file]
    return shlex.join(parts)


def against_device_only(summary: dict, device_only: dict) -> str:
    """One line: an arm's median TTFT against the device-only arm's, and its hit rate against the ideal."""
    parts = []
    ttft, base = summary.get("ttft_median_s"), device_only.get("ttft_median_s")
    if ttft is not None and base:
        parts.append(f"median TTFT {ttft / base:.2f}x the device-only arm's")
    hit, ideal = summary.get("hit_rate"), summary.get("ideal_hit_rate")
    if hit is not None and ideal:
        parts.append(f"hit rate {hit:.1%}, {hit / ideal:.1%} of the ideal ({ideal:.1%})")
    storage = (summary.get("hit_rate_by_tier") or {}).get("storage")
    if storage:
        parts.append(f"{storage:.1%} of prompt tokens read from storage")
    return f"{summary['arm']}: " + ", ".join(parts)


def describe(args: argparse.Namespace, workload: GSPParams, device_tokens: int, ratio: float, storage_dir: str) -> str:
    """What is about to run, in words: the workload and the memory every arm gets."""
    conversations = workload.num_groups * workload.prompts_per_group
    return (
        f"hicache demo on {args.model}: {conversations} conversations ({workload.num_groups} groups sharing a "
        f"{workload.system_prompt_len}-token system prompt) x {workload.num_turns} turns, all at once; "
        f"questions {workload.question_len} tokens, answers {workload.output_len} tokens.\n"
        f"Working set ~{working_set_tokens(workload)} tokens. Every arm gets a device pool of {device_tokens} "
        f"tokens; the host tier is {ratio:g}x that; storage is a file store in {storage_dir}."
    )


def run_demo(args: argparse.Namespace) -> int:
    # Imported here: matplotlib and the benchmark would otherwise slow down every `hicache` command.
    from hicache.bench.report import PLOTS, per_round_table, write_report
    from hicache.bench.runner import run_bench

    started = time.perf_counter()
    # httpx logs every request at INFO; the demo's own lines would drown.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    workload = workload_from_args(args)
    engine_flags, storage_flags = forwarded_engine_flags(args)  # before anything is created: refuses arm flags
    device_tokens = args.max_total_tokens
    if device_tokens is None:
        device_tokens = device_pool_tokens(workload, args.page_size)
    ratio = args.hicache_ratio if args.hicache_ratio is not None else host_ratio(workload, device_tokens)
    out = pathlib.Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {out}: {exc.strerror}") from None
    rows = out / "demo.jsonl"

    with contextlib.ExitStack() as stack:
        storage_dir = args.hicache_storage_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="hicache-demo-")
        )
        policy = args.hicache_storage_prefetch_policy or STORAGE_PREFETCH_POLICY
        arms = build_arms(args.model, engine_flags, device_tokens, ratio, storage_dir, policy, storage_flags)
        print(describe(args, workload, device_tokens, ratio, storage_dir))
        print(
            f"The same measurement with `hicache bench`:\n  {bench_command(workload, arms, str(out / 'bench.jsonl'))}\n"
        )
        print(f"Running {len(arms)} arms, one `hicache serve` each ...", flush=True)
        config = BenchConfig(
            workload=workload, arms=arms, flush_cache=True, output_file=str(rows), progress=not args.disable_tqdm
        )
        summaries = run_bench(config)

    table = write_report([rows], out)
    print(f"\n{table}\n\nPer round (TTFT mean / hit rate / ideal hit rate):\n\n{per_round_table(summaries)}\n")
    by_name = {s["arm"]: s for s in summaries}
    print("Against the device-only arm (same device pool):")
    for name in ARM_NAMES[2:]:
        print("  " + against_device_only(by_name[name], by_name[ARM_NAMES[1]]))
    print(f"\nRows: {rows}\nReport: {out / 'report.md'}\nPlots: " + ", ".join(str(out / name) for name in PLOTS))
    print(f"Wall time: {time.perf_counter() - started:.0f} s")
    failed = sum(s["failed"] for s in summaries)
    if failed:
        print(f"{failed} requests failed; see the log above")
        return 1
    return 0


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "demo",
        "multi-turn shared-prefix workload through no cache, device, device+host and storage (the main job)",
        __doc__,
    )
    add_engine_args(p)
    # Pool sizes follow from the workload unless given; engine flags given are passed to every arm.
    p.set_defaults(model="smollm2", max_total_tokens=None, hicache_ratio=None, hicache_storage_prefetch_policy=None)
    p.add_argument("--out", default=DEFAULT_OUT, help="directory for demo.jsonl, report.md and the plots")
    p.add_argument("--quick", action="store_true", help="a smaller workload (tests, a first look)")
    w = p.add_argument_group("workload (defaults: the preset; see `hicache bench --help`)")
    for name, flag in GSP_FLAGS.items():
        preset = f"{getattr(FULL, name)} ({getattr(QUICK, name)} with --quick)"
        w.add_argument(flag, dest=name, type=int, default=None, metavar="N", help=f"default {preset}")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    p.set_defaults(func=run_demo)
