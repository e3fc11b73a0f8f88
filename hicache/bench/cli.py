"""`hicache bench` and `hicache bench report` (the `bench` part of the design): argparse front of
`run_bench` and `write_report`.

    hicache bench --dataset generated-shared-prefix --gsp-num-groups 2 --gsp-num-turns 4 \\
        --launch "--model tiny --disable-radix-cache" --launch "--model tiny" --flush-cache --output-file out.jsonl
    hicache bench --base-url http://127.0.0.1:30000 --model tiny --dataset multi-round --num-users 4
    hicache bench report out.jsonl --out report/

Flag choices. The generated-shared-prefix flags are SGLang's `--gsp-*` with SGLang's meaning. The
multi-round flags follow LMCache's multi-round QA benchmark (`--num-users`, `--num-rounds`,
`--answer-len`), with `-len` added to its `--shared-system-prompt` / `--user-history-prompt` (they are
lengths in tokens here too), `--question-len` for the per-round question, and `--user-join-interval`
(seconds between two users joining) in place of LMCache's QPS-derived gap. Traffic flags are SGLang's
bench_serving ones; `--max-concurrency` counts conversations, since a conversation's turns are
sequential. `--launch-warm` is `--launch` for an arm measured on a restarted server after a warming pass.

`--base-url` is the server's root (`/v1/...` and `/flush_cache` are appended). A serve-flag string with
no space must be attached with `=` (`--launch=--disable-radix-cache`), or argparse takes it for an option
of its own.
"""

from __future__ import annotations

import argparse
import logging
import math
import shlex
from collections import Counter
from dataclasses import replace

from hicache.bench.client import ENDPOINTS
from hicache.bench.config import Arm, BenchConfig
from hicache.bench.workload import DATASETS, GSP, GSPParams, MultiRoundParams
from hicache.config import from_args
from hicache.config.flags import add_command
from hicache.errors import UserError, json_object


class _AppendArm(argparse.Action):
    """--launch, --launch-warm and --launch-pd append to one list, so arms keep the order they were
    given in: (flags, or [prefill flags, decode flags] for --launch-pd; the option)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        arms = list(getattr(namespace, "launch", None) or [])
        arms.append((values, option_string))
        namespace.launch = arms


def _split(flags: str, option: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(flags))
    except ValueError as exc:
        raise UserError(f"cannot split {option} {flags!r}: {exc}") from None


def _arms(args: argparse.Namespace) -> tuple[Arm, ...]:
    launches: list[tuple[str | list[str], str]] = args.launch or []
    if args.base_url and launches:
        raise UserError("give either --base-url or --launch, not both")
    if not args.base_url and not launches:
        raise UserError("give a target: --base-url URL, or --launch SERVE_FLAGS (or --launch-pd) once per arm")
    count = len(launches) or 1
    names = [n.strip() for n in args.arm_names.split(",")] if args.arm_names else []
    if names and len(names) != count:
        raise UserError(f"--arm-names has {len(names)} names for {count} arms")
    if args.base_url:
        return (Arm(names[0] if names else args.base_url),)
    arms = []
    for i, (flags, option) in enumerate(launches):
        if option == "--launch-pd":
            prefill, decode = flags
            pd = (_split(prefill, option), _split(decode, option))
            default = f"P/D: prefill [{prefill.strip()}] decode [{decode.strip()}]"
            arms.append(Arm(names[i] if names else default, pd_args=pd))
            continue
        assert isinstance(flags, str)
        warm = option == "--launch-warm"
        default = (flags.strip() or "(default flags)") + (" +warm-restart" if warm else "")
        arms.append(Arm(names[i] if names else default, _split(flags, option), warm))
    if not names:
        # Two arms with the same flags get numbered rather than refused.
        totals, seen = Counter(arm.name for arm in arms), Counter[str]()
        for i, arm in enumerate(arms):
            if totals[arm.name] > 1:
                seen[arm.name] += 1
                arms[i] = replace(arm, name=f"{arm.name} #{seen[arm.name]}")
    return tuple(arms)


def workload_from_args(args: argparse.Namespace) -> GSPParams | MultiRoundParams:
    """The workload the flags of `add_workload_args` describe (also `hicache simulate`'s)."""
    if args.dataset == GSP:
        return from_args(GSPParams, args, prefix="gsp_", seed=args.seed)
    return from_args(MultiRoundParams, args, user_join_interval_s=args.user_join_interval)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    workload = workload_from_args(args)
    base_url = args.base_url.rstrip("/") if args.base_url else None
    if base_url and base_url.endswith("/v1"):
        base_url = base_url[: -len("/v1")]  # an OpenAI-style base URL; the benchmark needs the server root
    # Fields named like their flags come from `args`; the rest are derived here.
    return from_args(
        BenchConfig,
        args,
        workload=workload,
        arms=_arms(args),
        base_url=base_url,
        extra_body=json_object(args.extra_body, "--extra-body"),
        request_timeout_s=args.request_timeout,
        progress=not args.disable_tqdm,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    # Imported here: matplotlib would otherwise slow down every `hicache` command.
    from hicache.bench.report import markdown_table
    from hicache.bench.runner import run_bench

    # httpx logs every request at INFO: thousands of lines that would bury the benchmark's own.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    summaries = run_bench(config_from_args(args))
    print(markdown_table(summaries))
    if args.output_file:
        print(f"\nrows and summaries written to {args.output_file}")
    # A run where an arm completed nothing measured nothing: make that visible to scripts.
    return 1 if any(s["completed"] == 0 for s in summaries) else 0


def cmd_report(args: argparse.Namespace) -> int:
    from hicache.bench.report import write_report

    print(write_report(args.files, args.out))
    print(f"\nreport.md and plots written to {args.out}")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="Markdown table and plots from `hicache bench` output files")
    p.add_argument("files", nargs="+", help="JSONL files written by --output-file")
    p.add_argument("--out", required=True, help="directory for report.md and the PNG plots")
    p.set_defaults(func=cmd_report)


# The multi-round workload's flags: (flag, MultiRoundParams field, type, help).
MULTI_ROUND_FLAGS = (
    ("--num-users", "num_users", int, "conversations"),
    ("--num-rounds", "num_rounds", int, "questions per user"),
    ("--shared-system-prompt-len", "shared_system_prompt_len", int, "tokens of the system prompt every user shares"),
    ("--user-history-prompt-len", "user_history_prompt_len", int,
     "tokens of each user's private history, sent with the first question"),
    ("--question-len", "question_len", int, "tokens per question"),
    ("--answer-len", "answer_len", int, "tokens per answer"),
    ("--user-join-interval", "user_join_interval_s", float, "seconds between two users joining"),
)  # fmt: skip


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "bench", "load generator and reporter for OpenAI-compatible servers (`bench report` for plots)", __doc__
    )
    p.set_defaults(func=cmd_bench)
    _add_report(
        p.add_subparsers(
            dest="bench_command", metavar="{report}", parser_class=type(p), help="report: plots and tables of a run"
        )
    )

    target = p.add_argument_group("target")
    target.add_argument("--base-url", help="an OpenAI-compatible server to measure (one arm)")
    target.add_argument(
        "--launch",
        "--launch-warm",
        dest="launch",
        action=_AppendArm,
        metavar="SERVE_FLAGS",
        help="one arm: `hicache serve` flags for a fresh server on a free 127.0.0.1 port, stopped after the arm; "
        "repeat per arm. --launch-warm: run the workload once, restart that server with the same flags, and "
        "measure the second pass (what survives a restart)",
    )
    target.add_argument(
        "--launch-pd",
        dest="launch_pd",
        nargs=2,
        action=_AppendArm,
        metavar=("PREFILL_FLAGS", "DECODE_FLAGS"),
        help="one arm: a prefill-decode deployment (a prefill server, a decode server, `hicache router` in front), "
        "each on a free 127.0.0.1 port; the flags are `hicache serve` flags without --disaggregation-mode",
    )
    target.add_argument("--arm-names", help="comma-separated names, one per arm")
    target.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="completions",
        help="completions sends the chat template rendered by the benchmark (exact tokens); chat sends messages",
    )
    target.add_argument("--model", help="the requests' model name (default: the arm's --model, or GET /v1/models)")
    target.add_argument("--tokenizer", help="model whose tokenizer measures lengths (default: the model)")

    add_workload_args(p)

    traffic = p.add_argument_group("traffic")
    traffic.add_argument(
        "--max-concurrency", type=int, default=None, help="conversations in flight at once (default: all)"
    )
    traffic.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="conversation starts per second, Poisson (default inf: all at once)",
    )
    traffic.add_argument(
        "--flush-cache",
        action="store_true",
        help="POST /flush_cache after the warm-up of each arm (ignored where the server has none)",
    )
    traffic.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests before each arm")
    traffic.add_argument(
        "--extra-body",
        default='{"ignore_eos": true}',
        help="JSON merged into every request body (ignore_eos makes output lengths exact; "
        "pass '{}' for servers that reject it)",
    )
    traffic.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    traffic.add_argument("--output-file", help="JSONL: one row per request and one summary row per arm")
    traffic.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The dataset flags (`workload_from_args` reads them); `hicache simulate` takes them too."""
    data = parser.add_argument_group("workload")
    data.add_argument("--dataset", choices=DATASETS, default=GSP, help="the conversations sent")
    data.add_argument("--seed", type=int, default=1, help="seed of the generated prompts")
    d = GSPParams()
    data.add_argument("--gsp-num-groups", type=int, default=d.num_groups, help="groups sharing one system prompt")
    data.add_argument("--gsp-prompts-per-group", type=int, default=d.prompts_per_group, help="conversations per group")
    data.add_argument("--gsp-system-prompt-len", type=int, default=d.system_prompt_len, help="tokens")
    data.add_argument("--gsp-question-len", type=int, default=d.question_len, help="tokens per turn's question")
    data.add_argument("--gsp-output-len", type=int, default=d.output_len, help="tokens per answer")
    data.add_argument("--gsp-num-turns", type=int, default=d.num_turns, help="turns per conversation")
    data.add_argument("--gsp-range-ratio", type=float, default=d.range_ratio,
                      help="lengths are sampled uniformly in [ratio * len, len]")  # fmt: skip
    m = MultiRoundParams()
    for flag, field, kind, doc in MULTI_ROUND_FLAGS:
        data.add_argument(flag, type=kind, default=getattr(m, field), help=f"multi-round: {doc}")
