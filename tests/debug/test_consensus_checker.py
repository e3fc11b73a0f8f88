"""The rank consensus checker: marked calls are recorded per rank in logical order; ranks that agree pass,
the first unequal entry is reported with its call, the ranks and both values; arguments that are not
selected are ignored; and disabled, it leaves every method exactly as it was."""

import pytest

from hicache.cli import main
from hicache.debug.consensus_checker import (
    DIVERGENCE,
    ENV_ENABLE,
    ENV_LOG_DIR,
    ConsensusChecker,
    check_logs,
    consensus_checked,
    first_divergence,
)
from hicache.parallel.parallel import ParallelContext


class Cache:
    """Stands in for a scheduler or cache with marked decisions."""

    def __init__(self, ready: int) -> None:
        self.ready = ready

    @consensus_checked(params=("rid",), results=("result",))
    def admit(self, rid: int, wall_clock: float) -> int:
        return self.ready  # the matched length: must agree; wall_clock is not selected

    @consensus_checked(params={"n": lambda ns: len(ns["ops"])}, results={"first": "result.0"})
    def consume(self, ops: list) -> dict:
        return {"0": ops[0]}

    def unmarked(self, x: int) -> int:
        return x


def record(log_dir, rank: int, clocks: list[float], ready: int = 5, last_ready: int = 5) -> None:
    """One rank's run: two equal decisions per clock, then a last admission answering `last_ready`."""
    env = {ENV_ENABLE: "1", ENV_LOG_DIR: str(log_dir)}
    checker = ConsensusChecker(ParallelContext(tp_size=2, tp_rank=rank), env=env)
    cache = Cache(ready)
    checker.instrument(cache)
    for rid, clock in enumerate(clocks):
        cache.admit(rid, wall_clock=clock)
        cache.consume(["a", "b", "c"][: rid + 1])
    cache.unmarked(rank)  # not recorded at all
    cache.ready = last_ready
    cache.admit(99, 0.0)
    checker.close()  # writes the log without a collective (no process group in a unit test)


def test_agreeing_ranks_pass_and_unselected_arguments_are_ignored(tmp_path):
    record(tmp_path, 0, clocks=[0.1, 0.2])
    record(tmp_path, 1, clocks=[7.0, 8.0])  # wall_clock is not selected: it may differ
    agree, report = check_logs(tmp_path)
    assert agree, report
    assert "2 ranks agree on all 5 common entries" in report


def test_a_divergence_reports_its_first_entry(tmp_path):
    record(tmp_path, 0, clocks=[0.1, 0.2, 0.3], last_ready=5)
    record(tmp_path, 1, clocks=[0.1, 0.2, 0.3], last_ready=6)
    agree, report = check_logs(tmp_path)
    assert not agree
    first_line = report.splitlines()[0]
    assert first_line.startswith(DIVERGENCE)
    assert "entry #6 (Cache.admit)" in first_line and "rank(s) 1 differ from rank 0" in first_line
    assert '"result": {"result": 5}' in report and '"result": {"result": 6}' in report
    assert "rank 0 (tp0of2_pp0of1)" in report and "rank 1 (tp1of2_pp0of1)" in report


def test_a_different_call_sequence_is_a_divergence(tmp_path):
    record(tmp_path, 0, clocks=[0.1], ready=5)
    record(tmp_path, 1, clocks=[0.1, 0.2], ready=5)  # one more admission: a different call sequence
    agree, report = check_logs(tmp_path)
    assert not agree and "entry #2" in report


def test_disabled_changes_nothing():
    checker = ConsensusChecker(ParallelContext(tp_size=2), env={})
    cache = Cache(5)
    checker.instrument(cache)
    assert "admit" not in vars(cache)  # no wrapper: the class's own function runs
    assert Cache.admit.__qualname__ == "Cache.admit"  # the decorator returned the function itself
    checker.checkpoint()  # no collective, nothing written
    checker.close()


def test_call_order_differences_and_short_logs():
    def entry(seq: int, call: str, result: int) -> dict:
        return {"seq": seq, "call": call, "params": {}, "result": {"result": result}}

    a = [entry(0, "admit", 1), entry(1, "consume", 2), entry(2, "admit", 3)]
    b = [entry(0, "admit", 1), entry(1, "admit", 3)]
    found = first_divergence({0: a, 1: b})
    assert found is not None and found.ranks == (1,) and found.entries[1]["call"] == "admit"
    assert first_divergence({0: a, 1: a[:2]}) is None  # a log cut short agrees on what it has
    assert first_divergence({0: a, 1: a[:2]}, complete=True) is not None


def test_cli_exit_codes(tmp_path, capsys):
    ok_dir, bad_dir = tmp_path / "ok", tmp_path / "bad"
    for rank in (0, 1):
        record(ok_dir, rank, clocks=[0.5])
        record(bad_dir, rank, clocks=[0.5], last_ready=5 + rank)
    assert main(["consensus-check", str(ok_dir)]) == 0
    assert "agree" in capsys.readouterr().out
    assert main(["consensus-check", str(bad_dir)]) == 1
    assert DIVERGENCE in capsys.readouterr().out
    assert main(["consensus-check", str(tmp_path / "empty")]) == 2


@pytest.mark.parametrize("value", ["", "0", "false"])
def test_env_off_values(value, tmp_path):
    assert not ConsensusChecker(env={ENV_ENABLE: value, ENV_LOG_DIR: str(tmp_path)}).enabled
