"""`hicache consensus-check DIR`: compare the rank logs the consensus checker wrote (one rank<N>.jsonl per
rank, from HICACHE_CONSENSUS_LOG_DIR) and report the first entry on which ranks disagree."""

from __future__ import annotations

import argparse

from hicache.debug.consensus_checker import check_logs
from hicache.errors import UserError


def cmd_consensus_check(args: argparse.Namespace) -> int:
    agree, report = check_logs(args.directory)
    if not agree and report.startswith("no rank logs"):
        raise UserError(report)
    print(report, flush=True)
    return 0 if agree else 1


def add_consensus_check_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "consensus-check",
        help="compare rank consensus checker logs; exit 1 and show the first divergence if ranks disagree",
    )
    p.add_argument("directory", help="the HICACHE_CONSENSUS_LOG_DIR of the run")
    p.set_defaults(func=cmd_consensus_check)
