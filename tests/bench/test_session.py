"""An arm's traffic schedule: conversations start as a seeded Poisson process, never before their join time."""

from __future__ import annotations

import math

from hicache.bench.session import arrival_times
from hicache.bench.workload import Conversation


def test_arrivals_follow_rate_and_join_times() -> None:
    convs = [Conversation(i, 0, "", "", (), start_offset_s=s) for i, s in enumerate([0.0, 0.0, 5.0, 0.0])]
    assert arrival_times(convs, math.inf, 1) == [0.0, 0.0, 5.0, 0.0]
    times = arrival_times(convs, 2.0, 1)
    assert times == arrival_times(convs, 2.0, 1)  # the same schedule for every arm
    assert times[0] == 0.0 and 0 < times[1] and times[2] >= 5.0 and times[1] < times[3]
