"""The simulator's virtual-time links: a copy's ACK becomes ready exactly when the clock passes its
cost on the link (latency + bytes / bandwidth after the link frees), in submission order; on the
storage link, puts at the write bandwidth and reads at the read bandwidth; an op waited for before its
time runs at once."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache import TransferOp
from hicache.sim.cost import Storage
from hicache.sim.links import StorageLink, VirtualClock, VirtualLink

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
        free_at = max(free_at, clock.now) + (LATENCY + pages * PAGE_BYTES / BANDWIDTH)
        ends.append(free_at)
    assert link.bytes_moved == sum(p for _, p in submissions) * PAGE_BYTES
    for index, end in enumerate(ends):
        link.run_until(end - 1e-9)
        assert not ops[index].done.is_set(), f"op {index} finished before its cost had passed"
        link.run_until(end)
        assert ops[index].done.is_set()
    assert ran == list(range(len(submissions)))  # each op's copy ran once, in order


def test_the_storage_link_costs_puts_at_the_write_bandwidth_and_runs_a_waited_op_at_once():
    clock = VirtualClock()
    link = StorageLink(clock, Storage(read_bandwidth=4 * BANDWIDTH, write_bandwidth=BANDWIDTH, latency_s=LATENCY),
                       PAGE_BYTES)  # fmt: skip
    put = link.submit(TransferOp("storage_put", lambda op: None, pages=10))
    read = link.submit(TransferOp("storage_read", lambda op: None, pages=8))
    assert link.next_completion == LATENCY + 10 * PAGE_BYTES / BANDWIDTH
    assert link.moved() == {"storage->host": 8 * PAGE_BYTES, "host->storage": 10 * PAGE_BYTES}
    read.wait()  # a stopped prefetch waits for its read: it does not wait for the clock
    assert read.done.is_set() and not put.done.is_set() and clock.now == 0
    link.run_until(LATENCY + 10 * PAGE_BYTES / BANDWIDTH)
    assert put.done.is_set()
