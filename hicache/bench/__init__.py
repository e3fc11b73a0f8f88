"""`hicache bench`: a load generator and reporter for OpenAI-compatible servers, built around
multi-turn conversations with shared prefixes, and measuring every cache hit rate against the ideal one
of the traffic it actually sent.

Modules: `workload` (datasets), `client` (streaming requests, timing), `metrics` (ideal hit rate,
aggregation), `launcher` (servers per arm), `config` (arms, `BenchConfig`), `session` (one arm's
traffic and the log replayed for the ideal), `runner` (`run_bench`), `report` (table, plots), `cli`.
"""

from hicache.bench.config import Arm, BenchConfig
from hicache.bench.launcher import ServerProcess
from hicache.bench.runner import run_bench
from hicache.bench.workload import GSPParams, MultiRoundParams

__all__ = ["Arm", "BenchConfig", "GSPParams", "MultiRoundParams", "ServerProcess", "run_bench"]
