"""The `hicache` command: generate, serve, bench, simulate, demo, consensus-check. A user error prints one line and
exits 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from hicache.config import EngineConfig
from hicache.config.flags import add_engine_args
from hicache.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), like every other user error here."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    try:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as exc:
        raise UserError(f"cannot read --prompts-file: {exc.strerror}: {args.prompts_file}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{args.prompts_file}:{number}: not a JSON string") from None
        if not isinstance(value, str):
            raise UserError(f"{args.prompts_file}:{number}: expected a JSON string, got {type(value).__name__}")
        prompts.append(value)
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from hicache import Engine, SamplingParams
    from hicache.engine.launch import rank_only_node

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    cfg = EngineConfig.from_args(args)
    ranks_only = rank_only_node(cfg)
    if ranks_only is not None:
        return ranks_only()
    prompts = _read_prompts(args)
    with Engine(cfg) as engine:
        # In order, one at a time: a later prompt can reuse what an earlier one cached.
        for prompt in prompts:
            result = engine.generate([prompt], params)[0]
            if args.json:
                print(json.dumps(result.to_json()), flush=True)
            else:
                print(result.text, flush=True)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run prompts through one engine, offline")
    add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", help="one JSON string per line, run in order through one engine")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=None, help="sampling seed when --temperature > 0")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hicache", description=__doc__)
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    from hicache.bench.cli import add_bench_command
    from hicache.debug.cli import add_consensus_check_command
    from hicache.demo import add_demo_command
    from hicache.router.cli import add_router_command
    from hicache.server.cli import add_serve_command
    from hicache.sim.cli import add_simulate_command

    return [
        add_demo_command, add_serve_command, add_router_command, add_bench_command, add_simulate_command,
        add_consensus_check_command,
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except UserError as exc:
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
