"""Rank consensus checker (docs/DESIGN.md, "debugging"): finds the first cache or scheduling decision on
which ranks disagree, before it surfaces as a shape mismatch or a hung collective.

- `@consensus_checked(params=..., results=...)` (defined in hicache/parallel/divergence.py, re-exported
  here) marks a scheduler or cache method and selects which of its arguments (before the call) and
  results (after it) must be equal on every rank. The mark is an attribute on the function, which the
  decorator returns unchanged: an unchecked engine runs exactly the code it would run without the
  checker.
- `ConsensusChecker` is owned by one rank's scheduler. It reads `HICACHE_ENABLE_RANK_CONSENSUS_CHECKER`
  when it is built; when enabled, `instrument(obj)` wraps the marked methods of that object (and only
  of that object), each call is recorded in the rank's logical order and appended to
  `$HICACHE_CONSENSUS_LOG_DIR/rank<N>.jsonl`, and `checkpoint()` (once per scheduler step, on every
  rank) compares a digest of the entries recorded since the last checkpoint across ranks. PP stages
  reach a call at different wall-clock times but at the same checkpoint, so the comparison is by
  logical position, not time.
- `first_divergence` finds the first unequal entry; the online check raises `RankDivergenceError` with
  it, and `hicache consensus-check DIR` reports it from the logs offline.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

# The marks and the error live below parallel/ so that agreement code can raise and mark without importing
# the checker; they are re-exported here, the checker's public face for the scheduler and the cache.
from hicache.parallel.divergence import SPEC_ATTR, CheckSpec, RankDivergenceError, consensus_checked
from hicache.parallel.parallel import ParallelContext

logger = logging.getLogger(__name__)

ENV_ENABLE = "HICACHE_ENABLE_RANK_CONSENSUS_CHECKER"
ENV_LOG_DIR = "HICACHE_CONSENSUS_LOG_DIR"
DEFAULT_LOG_DIR = "hicache-consensus-logs"
DIVERGENCE = "Found rank divergence"

__all__ = [
    "DIVERGENCE", "ENV_ENABLE", "ENV_LOG_DIR", "ConsensusChecker", "Divergence", "RankDivergenceError",
    "check_logs", "consensus_checked", "first_divergence", "load_logs", "plain",
]  # fmt: skip


def _select(selector: Any, namespace: Mapping[str, Any]) -> Any:
    if callable(selector):
        return selector(namespace)
    head, *rest = selector.split(".")
    value = namespace[head]
    for part in rest:
        value = value[part] if isinstance(value, Mapping) else getattr(value, part)
    return value


def plain(value: Any) -> Any:
    """A JSON value that is equal on two ranks exactly when the decisions are; objects without a
    logical value (tree nodes, tensors) must be selected down to one, never compared by identity."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, torch.Tensor) and value.numel() <= 64:
        return value.tolist()
    raise TypeError(f"the consensus checker cannot compare a {type(value).__name__}; select a plain value")


@dataclass(frozen=True)
class Divergence:
    reference_rank: int
    ranks: tuple[int, ...]  # ranks whose entry differs from the reference rank's
    entries: dict[int, dict | None]  # rank -> its entry at `index` (None: that rank's log ended)
    names: dict[int, str]  # rank -> "tpXofY_ppZofW"

    def report(self) -> str:
        first = next(e for e in self.entries.values() if e is not None)
        ranks = ", ".join(map(str, self.ranks))
        at = f"entry #{first['seq']} ({first['call']})"
        lines = [f"{DIVERGENCE} at {at}: rank(s) {ranks} differ from rank {self.reference_rank}"]
        for rank in (self.reference_rank, *self.ranks):
            entry = self.entries[rank]
            shown = (
                "<no entry: its log ends here>"
                if entry is None
                else json.dumps({k: entry[k] for k in ("call", "params", "result")}, sort_keys=True)
            )
            lines.append(f"  rank {rank} ({self.names.get(rank, '?')}): {shown}")
        return "\n".join(lines)


def _comparable(entry: dict | None) -> Any:
    return None if entry is None else (entry["call"], entry["params"], entry["result"])


def first_divergence(
    logs: Mapping[int, Sequence[dict]], names: Mapping[int, str] | None = None, complete: bool = False
) -> Divergence | None:
    """The first logical position where some rank's entry differs from the lowest rank's. Logs cut at
    different lengths (a run that was stopped, stages that lag) are compared over their common prefix
    unless `complete` says every log covers the same span."""
    if not logs:
        return None
    ranks = sorted(logs)
    ref = ranks[0]
    length = max(len(v) for v in logs.values()) if complete else min(len(v) for v in logs.values())
    for i in range(length):
        at = {r: (logs[r][i] if i < len(logs[r]) else None) for r in ranks}
        differing = tuple(r for r in ranks[1:] if _comparable(at[r]) != _comparable(at[ref]))
        if differing:
            return Divergence(ref, differing, at, dict(names or {}))
    return None


class ConsensusChecker:
    """One rank's recorder. Built disabled unless the environment variable is set (read once, here)."""

    def __init__(self, pctx: ParallelContext | None = None, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.enabled = env.get(ENV_ENABLE, "").lower() not in ("", "0", "false", "no")
        self.pctx = pctx or ParallelContext()
        if not self.enabled:
            return
        self.log_dir = Path(env.get(ENV_LOG_DIR) or DEFAULT_LOG_DIR)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._seq = 0
        self._batch: list[dict] = []
        # Open for the checker's life (closed by close()): entries are appended at every checkpoint.
        self._log = open(self.log_dir / f"rank{self.pctx.rank}.jsonl", "w", encoding="utf-8")  # noqa: SIM115
        header = {"rank": self.pctx.rank, "name": self.pctx.suffix, "world_size": self.pctx.world_size}
        self._log.write(json.dumps({"header": header}) + "\n")
        logger.warning("rank consensus checker on: rank %d logs to %s", self.pctx.rank, self._log.name)

    # ---- recording -----------------------------------------------------------------------------

    def instrument(self, obj: object) -> None:
        """Wrap the marked methods of `obj` (this instance only). A no-op when disabled."""
        if not self.enabled:
            return
        seen: set[str] = set()
        for cls in type(obj).__mro__:
            for name, attr in vars(cls).items():
                if name in seen:
                    continue
                seen.add(name)
                spec = getattr(attr, SPEC_ATTR, None)
                if spec is not None:
                    setattr(obj, name, self._wrap(getattr(obj, name), f"{type(obj).__name__}.{name}", spec))

    def _wrap(self, method: Callable[..., Any], call: str, spec: CheckSpec) -> Callable[..., Any]:
        signature = inspect.signature(method)
        owner = method.__self__  # type: ignore[attr-defined]

        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            namespace: dict[str, Any] = {"self": owner, **bound.arguments}
            params = {label: plain(_select(s, namespace)) for label, s in spec.params}
            result = method(*args, **kwargs)
            namespace["result"] = result
            self.record(call, params, {label: plain(_select(s, namespace)) for label, s in spec.results})
            return result

        return checked

    def record(self, call: str, params: dict, result: dict) -> None:
        self._batch.append({"seq": self._seq, "call": call, "params": params, "result": result})
        self._seq += 1

    # ---- comparing -----------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Called by every rank at the same logical points (each scheduler step). Writes this rank's
        new entries and compares their digest with every other rank's; raises on a divergence."""
        if not self.enabled:
            return
        batch = self._write()
        if self.pctx.world_size == 1:
            return
        digest = hashlib.blake2b(json.dumps([_comparable(e) for e in batch]).encode(), digest_size=7)
        mine = torch.tensor([len(batch), int.from_bytes(digest.digest(), "little")], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.pctx.world_size)]
        torch.distributed.all_gather(every, mine, group=self.pctx.world_group)
        if all(torch.equal(t, every[0]) for t in every):
            return
        # Rare and fatal: now exchange the entries themselves to name the first unequal one.
        gathered: list[Any] = [None] * self.pctx.world_size
        torch.distributed.all_gather_object(gathered, (self.pctx.suffix, batch), group=self.pctx.world_group)
        logs = {rank: entries for rank, (_, entries) in enumerate(gathered)}
        names = {rank: name for rank, (name, _) in enumerate(gathered)}
        found = first_divergence(logs, names, complete=True)
        raise RankDivergenceError(found.report() if found else f"{DIVERGENCE}: digests differ but no entry does")

    def _write(self) -> list[dict]:
        batch, self._batch = self._batch, []
        for entry in batch:
            self._log.write(json.dumps(entry, sort_keys=True) + "\n")
        self._log.flush()
        return batch

    def close(self) -> None:
        """Write what is recorded without comparing (at shutdown, when peers may be gone)."""
        if self.enabled and not self._log.closed:
            self._write()
            self._log.close()


def load_logs(directory: str | os.PathLike[str]) -> tuple[dict[int, list[dict]], dict[int, str]]:
    """Every rank's recorded entries under `directory` (files rank<N>.jsonl)."""
    logs: dict[int, list[dict]] = {}
    names: dict[int, str] = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        entries = []
        rank = None
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if "header" in record:
                    rank = record["header"]["rank"]
                    names[rank] = record["header"]["name"]
                else:
                    entries.append(record)
        if rank is None:
            rank = int(path.stem.removeprefix("rank"))
        logs[rank] = entries
    return logs, names


def check_logs(directory: str | os.PathLike[str]) -> tuple[bool, str]:
    """(True, summary) when every rank agrees over the logged span, else (False, the divergence)."""
    logs, names = load_logs(directory)
    if not logs:
        return False, f"no rank logs (rank<N>.jsonl) in {directory}"
    found = first_divergence(logs, names)
    if found is not None:
        return False, found.report()
    lengths = ", ".join(f"rank {r}: {len(v)}" for r, v in sorted(logs.items()))
    common = min(len(v) for v in logs.values())
    return True, f"{len(logs)} ranks agree on all {common} common entries ({lengths})"
