"""Host memory for pools that share logical page ids (docs/DESIGN.md, "host pool": target + draft grouped).

A speculative draft keeps its own device pool, indexed by the target's logical pages, so a prefix's
pages hold both models' state at the same ids. Its host state is laid out one of two ways
(docs/DESIGN.md, "Speculative decoding: the draft's state"):

- packed: the draft's layers are appended to the target's host pool (one buffer, one slot mapping),
  which needs the same row shape, dtype and token indexing (hicache/spec/draft_state.py checks);
- sidecar: a host pool of the draft's own row and dtype, whose transfer indices are the target's host
  page ids (it follows the target pool's allocator, the declared source).

Either way a host page id means both models' state, so every backup and load moves both: a backup
copies every layer of both; the load event of target layer i also covers draft layer i (the draft's
layers past the target's ride with the target's last), so a layer's event means both buffers are
ready. Storage keeps one object per page and part (`PagePart`), the draft's under its own keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.mem.allocator import PageAllocator
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_pool import HostKVPool, PagePart, PartShard

DRAFT_PART = "draft"


@dataclass(frozen=True)
class DraftPools:
    """What the cache needs of a speculative draft: its device pool (the target's page ids), how its
    host state is laid out, and the identity its stored pages are namespaced by."""

    pool: DeviceKVPool
    layout: str  # "packed" or "sidecar"
    identity: str
    skip_restore: bool = False  # --debug-skip-draft-restore: loads move the target's layers only
    shard: PartShard | None = None  # this rank's copy of the draft within the whole (None: one rank)


def draft_event_layer(draft_layer: int, target_layers: int) -> int:
    """The target layer whose load event also covers draft layer `draft_layer`."""
    return min(draft_layer, target_layers - 1)


@dataclass(frozen=True)
class _Member:
    device: DeviceKVPool
    host: HostKVPool
    first_layer: int  # where its layers start in `host`


class HostPoolGroup:
    """The host tier's pool when a draft rides along: the same calls as a `HostKVPool` (allocator,
    backup, load_layer, page_bytes, parts), each moving the target's and the draft's state."""

    def __init__(
        self,
        target: DeviceKVPool,
        draft: DraftPools,
        num_pages: int,
        layout: str = "page_first",
        head_partition: int = 0,
    ) -> None:
        """`head_partition`: the target's KV heads per group of a page_unified layout (a packed draft's
        rows share it; a sidecar draft's own pool has one head a group)."""
        lt, ld = target.num_layers, draft.pool.num_layers
        if draft.layout == "packed":
            shared = HostKVPool(target, num_pages, layout, num_layers=lt + ld, head_partition=head_partition)
            self._target = _Member(target, shared, 0)
            self._draft = _Member(draft.pool, shared, lt)
        elif draft.layout == "sidecar":
            own = HostKVPool(target, num_pages, layout, head_partition=head_partition)
            self._target = _Member(target, own, 0)
            # One head a group: the draft's cells are then the same at every TP size (page_unified).
            own_draft = HostKVPool(draft.pool, num_pages, layout, allocator=own.allocator, head_partition=1)
            self._draft = _Member(draft.pool, own_draft, 0)
        else:
            raise ValueError(f"unknown draft layout {draft.layout!r}")
        self.draft_layout = draft.layout
        self.skip_restore = draft.skip_restore
        self.layout = layout
        self.page_size = target.page_size
        self.num_layers = lt  # load events: one per target layer
        self.parts = [
            PagePart("", self._target.host, range(lt)),
            PagePart(DRAFT_PART, self._draft.host, range(self._draft.first_layer, self._draft.first_layer + ld),
                     draft.identity, draft.shard),
        ]  # fmt: skip

    @property
    def allocator(self) -> PageAllocator:
        return self._target.host.allocator

    @property
    def page_bytes(self) -> int:
        return sum(part.payload_bytes for part in self.parts)

    # Page ownership is the target's: a draft's pages are never sharded (hicache/spec/build.py refuses a
    # page-sharded target), so its rows follow the target's pages wherever they are owned.
    @property
    def placement(self):  # noqa: ANN201 - the target pool's Placement
        return self._target.host.placement

    @property
    def shard_rank(self) -> int:
        return self._target.host.shard_rank

    def owns(self, host_page: int) -> bool:
        return self._target.host.owns(host_page)

    def resident_bytes(self) -> int:
        """Bytes of both models' state this rank holds for allocated host pages."""
        return self.allocator.used_by_class()[self.shard_rank] * self.page_bytes

    def backup(self, device: DeviceKVPool, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy whole pages device -> host, every layer of both models (`device`: the target's pool)."""
        assert device is self._target.device
        for m in (self._target, self._draft):
            m.host.backup(m.device, device_pages, host_pages, m.first_layer)

    def load_layer(self, device: DeviceKVPool, layer: int, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy target layer `layer` host -> device, and the draft layers its event covers."""
        assert device is self._target.device
        t, d = self._target, self._draft
        t.host.load_layer(t.device, layer, host_pages, device_pages, t.first_layer)
        if self.skip_restore:
            return
        for j in range(d.device.num_layers):
            if draft_event_layer(j, self.num_layers) == layer:
                d.host.load_layer(d.device, j, host_pages, device_pages, d.first_layer)


def make_host_pool(
    target: DeviceKVPool, num_pages: int, layout: str, draft: DraftPools | None = None, head_partition: int = 0
) -> HostKVPool | HostPoolGroup:
    """The host tier's pool: the target's alone, or grouped with a draft's (`head_partition`: KV heads
    per group of a page_unified layout)."""
    if draft is None:
        return HostKVPool(target, num_pages, layout, head_partition=head_partition)
    return HostPoolGroup(target, draft, num_pages, layout, head_partition)
