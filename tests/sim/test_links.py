"""The simulator's virtual-time links: a copy's ACK becomes ready exactly when the clock passes its
cost on the link (latency + bytes / bandwidth after the link frees), in submission order."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache import TransferOp
from hicache.sim.links import VirtualClock, VirtualLink

PAGE_BYTES = 1000
BANDWIDTH = 1e6  # bytes/s: a page takes a millisecond
LATENCY = 0.01


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.integers(1, 50)), min_size=1, max_size=8))
def test_an_op_completes_when_the_clock_passes_its_cost(submissions):
    """`submissions`: (gap before it is submitted, pages)."""
    clock = VirtualClock()
    link = VirtualLink("test", clock, BANDWIDTH, LATENCY, PAGE_BYTES)
    ran: list[int] = []
    ops, ends, free_at = [], [], 0.0
    for index, (gap, pages) in enumerate(submissions):
        clock.advance_to(clock.now + gap)
        ops.append(link.submit(TransferOp("backup", lambda op, i=index: ran.append(i), pages=pages)))
        free_at = max(free_at, clock.now) + LATENCY + pages * PAGE_BYTES / BANDWIDTH
        ends.append(free_at)
    assert link.bytes_moved == sum(p for _, p in submissions) * PAGE_BYTES
    for index, end in enumerate(ends):
        link.run_until(end - 1e-9)
        assert not ops[index].done.is_set(), f"op {index} finished before its cost had passed"
        link.run_until(end)
        assert ops[index].done.is_set()
    assert ran == list(range(len(submissions)))  # each op's copy ran once, in order
