"""The tree's KV events against the tree itself: after any sequence of inserts, host inserts, backups,
loads, locks and evictions on both tiers, the index built from the events names exactly the pages the
tree holds on each tier (by their chained hashes), so no place where a page comes or goes is missed."""

from hypothesis import given, settings

from hicache.cache.kv_events import DEVICE, HOST
from hicache.cache.tree_node import chain_hashes
from hicache.events import BlockIndex
from hicache.events.wire import wire_events
from tests.cache.test_radix_tiers import PAGE, Tiers, ops


class RecordedTiers(Tiers):
    def __init__(self) -> None:
        super().__init__()
        self.tree.events.enabled = True
        self.index = BlockIndex()

    def backup(self, index):
        """As HostTier.backup does: a node given a host copy is recorded there."""
        before = {n.id for n in self.tree.nodes() if n.host_pages is not None}
        super().backup(index)
        for node in self.tree.nodes():
            if node.host_pages is not None and node.id not in before:
                self.tree.events.stored(node, HOST)

    def take_events(self) -> None:
        """The recorded events, as the publisher sends them, applied to the index."""
        for event in self.tree.events.drain():
            for out in wire_events(event, PAGE, self.index.pages):
                self.index.apply(out)

    def held(self, on_tier) -> set[bytes]:
        return {h for node in self.tree.nodes() if on_tier(node) for h in chain_hashes(node, PAGE)}


@settings(max_examples=120, deadline=None)
@given(ops)
def test_events_track_every_page_on_both_tiers(operations):
    t = RecordedTiers()
    for op, arg in operations:
        t.apply(op, arg)
        t.take_events()
        assert t.index.pages[DEVICE] == t.held(lambda n: n.on_device)
        assert t.index.pages[HOST] == t.held(lambda n: n.host_pages is not None)
        assert len(t.index.pages[DEVICE]) == t.tree.total_pages
    assert t.index.chain_hashes() == t.index.pages  # the events carry what rebuilds the chain
    t.tree.reset()
    t.take_events()
    assert t.index.counts() == {"device": 0, "host": 0, "storage": 0}
