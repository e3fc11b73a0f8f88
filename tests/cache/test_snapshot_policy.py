"""`--mamba-track-interval` on `tiny-hybrid` (docs/DESIGN.md, "Hybrid models"): a hit ends at the last page
boundary where the policy keeps the recurrent state (every page, every 4 pages, a turn's end), the answers
equal the cache-off run under each, and they still do once the snapshots a policy does not keep are wiped
from the pool (so a hit that ended at one would read a zero state: the test can fail); `lookup` reports the
hit admission then takes."""

from __future__ import annotations

import random

import pytest

from hicache import Engine, SamplingParams
from hicache.errors import UserError
from hicache.model.families.hybrid import LINEAR, LINEAR_STATE, SNAPSHOT_ROWS

PAGE = 16
rng = random.Random(11)
Q = [rng.randrange(32, 127) for _ in range(96)]  # cached: 6 pages, a turn's end at 6
P = Q + [rng.randrange(32, 127) for _ in range(48)]  # reuses Q; cached: 9 pages, a turn's end at 9
D = P[:128] + [rng.randrange(32, 127) for _ in range(40)]  # shares 8 pages of P
# Tokens each request reuses, by --mamba-track-interval. Every page: D hits all 8 pages it shares (their window
# KV is held: P's own pages are within a window of its end, Q's are another request's). Every 4 pages: P's
# hit stops at 4. A turn's end: D's stops at Q's end, 6 pages.
HITS = {16: [0, 96, 128], 64: [0, 64, 128], 0: [0, 96, 96]}
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    with Engine(model="tiny-hybrid", disable_radix_cache=True) as engine:
        return [engine.generate([prompt], PARAMS)[0].token_ids for prompt in (Q, P, D)]


def wipe_unkept_snapshots(model, pool, tree, interval_pages: int) -> int:
    """Zero the state snapshot of every cached page boundary the policy does not keep (every `interval_pages`
    pages; 0: a node's end that a finished request marked); the number wiped."""
    offset, numel = model.linear_layout.span(LINEAR_STATE)
    slots = []
    for node in tree.nodes():
        if node.is_root or node.device_pages is None:
            continue
        first = sum(n.num_pages for n in tree.path_to_root(node)[:-1])
        for j, page in enumerate(node.device_pages):
            boundary = first + j + 1
            last = j == len(node.device_pages) - 1
            kept = boundary % interval_pages == 0 if interval_pages else last and node.snapshot_end
            if not kept:
                slots.extend(range((page + 1) * PAGE - SNAPSHOT_ROWS, (page + 1) * PAGE))
    for layer, kind in enumerate(model.layer_types):
        if kind == LINEAR:
            pool.buffers[layer][slots, offset : offset + numel] = 0
    return len(slots) // SNAPSHOT_ROWS


@pytest.mark.parametrize("interval", sorted(HITS), ids=lambda i: f"interval{i}")
def test_a_hit_ends_at_a_kept_snapshot_and_answers_equal_cache_off(reference, interval):
    with Engine(model="tiny-hybrid", mamba_track_interval=interval) as engine:
        scheduler = engine._runtime.scheduler
        results = [engine.generate([prompt], PARAMS)[0] for prompt in (Q, P)]
        wiped = engine.call_in_loop(lambda: wipe_unkept_snapshots(
            scheduler.runner.model, scheduler.runner.pool, scheduler.cache.tree, interval // PAGE))  # fmt: skip
        assert (wiped > 0) == (interval != PAGE)
        looked = engine.call_in_loop(lambda: scheduler.cache.lookup(D, ""))
        results.append(engine.generate([D], PARAMS)[0])
        assert [r.token_ids for r in results] == reference
        assert [r.cached_tokens for r in results] == HITS[interval]
        assert looked.total == HITS[interval][2]


def test_the_track_interval_is_refused_where_it_cannot_apply():
    with pytest.raises(UserError, match="has none"):
        Engine(model="tiny", mamba_track_interval=64)
    with pytest.raises(UserError, match="multiple of --page-size"):
        Engine(model="tiny-hybrid", mamba_track_interval=24)
