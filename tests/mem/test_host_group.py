"""Host memory of a target and a draft sharing page ids (hicache/mem/host_group.py): a backup copies
both models' pages, a layer's load event covers both models' layers before it is set, `packed` puts the
draft's layers in the target's buffer and `sidecar` in a pool of its own row and dtype following the
target's page ids, and each part of a page round-trips as its own storage payload."""

import pytest
import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_group import DraftPools, HostPoolGroup, draft_event_layer, make_host_pool
from hicache.mem.host_pool import LAYOUTS, HostKVPool
from hicache.mem.kv_layout import KVComponent, KVLayout

PAGES, PAGE = 8, 4
TARGET_LAYERS = 2
DRAFT_LAYERS = 3  # more than the target's: the last ones ride with the target's last layer


def pools(draft_layout: str) -> tuple[DeviceKVPool, DeviceKVPool]:
    target = DeviceKVPool(KVLayout.mha(1, 4), TARGET_LAYERS, PAGES, PAGE, torch.float32, torch.device("cpu"))
    if draft_layout == "packed":
        draft = DeviceKVPool(KVLayout.mha(1, 4), DRAFT_LAYERS, PAGES, PAGE, torch.float32, torch.device("cpu"))
    else:  # another row (state beside the KV) and dtype
        layout = KVLayout(KVLayout.mha(2, 4).components + (KVComponent("shift", (3,)),))
        draft = DeviceKVPool(layout, DRAFT_LAYERS, PAGES, PAGE, torch.bfloat16, torch.device("cpu"))
    for buf in target.buffers + draft.buffers:
        buf.normal_()
    return target, draft


def group(draft_layout: str, mem_layout: str = "page_first", skip: bool = False):
    target, draft = pools(draft_layout)
    host = make_host_pool(target, PAGES, mem_layout, DraftPools(draft, draft_layout, "draft-model", skip))
    assert isinstance(host, HostPoolGroup)
    return target, draft, host


def snapshot(pool: DeviceKVPool, pages: list[int]) -> list[torch.Tensor]:
    return [pool.pages_of_layer(layer)[pages].clone() for layer in range(pool.num_layers)]


@pytest.mark.parametrize("mem_layout", LAYOUTS)
@pytest.mark.parametrize("draft_layout", ["packed", "sidecar"])
def test_backup_and_layer_loads_move_both_models(draft_layout, mem_layout):
    target, draft, host = group(draft_layout, mem_layout)
    src, host_pages, dst = [1, 2, 5], [4, 0, 6], [3, 6, 7]
    want_target, want_draft = snapshot(target, src), snapshot(draft, src)
    host.backup(target, src, host_pages)
    for layer in range(TARGET_LAYERS):
        host.load_layer(target, layer, host_pages, dst)
        # The event of target layer `layer` may be set now: every draft layer it covers has landed.
        for j in range(DRAFT_LAYERS):
            landed = torch.equal(draft.pages_of_layer(j)[dst], want_draft[j])
            assert landed == (draft_event_layer(j, TARGET_LAYERS) <= layer), f"draft layer {j} after event {layer}"
        assert torch.equal(target.pages_of_layer(layer)[dst], want_target[layer])
    assert host.page_bytes == sum(part.payload_bytes for part in host.parts)


def test_packed_appends_the_drafts_layers_and_sidecar_follows_the_targets_page_ids():
    _, _, packed = group("packed")
    target_part, draft_part = packed.parts
    assert target_part.host is draft_part.host and target_part.host.num_layers == TARGET_LAYERS + DRAFT_LAYERS
    assert (target_part.layers, draft_part.layers) == (range(2), range(2, 5))
    _, _, sidecar = group("sidecar")
    target_part, draft_part = sidecar.parts
    assert draft_part.host is not target_part.host and draft_part.host.dtype == torch.bfloat16
    assert draft_part.host.allocator is target_part.host.allocator is sidecar.allocator  # one set of page ids
    assert (draft_part.name, draft_part.identity, target_part.name) == ("draft", "draft-model", "")


def test_skipping_the_draft_restore_moves_the_targets_layers_only():
    target, draft, host = group("sidecar", skip=True)
    want_target = snapshot(target, [1])
    host.backup(target, [1], [2])
    before = snapshot(draft, [5])
    for layer in range(TARGET_LAYERS):
        host.load_layer(target, layer, [2], [5])
    assert all(torch.equal(a, b) for a, b in zip(snapshot(draft, [5]), before))
    assert all(torch.equal(a, b) for a, b in zip(snapshot(target, [5]), want_target))


@pytest.mark.parametrize("mem_layout", LAYOUTS)
@pytest.mark.parametrize("draft_layout", ["packed", "sidecar"])
def test_each_part_round_trips_as_its_own_payload(draft_layout, mem_layout):
    target, _, host = group(draft_layout, mem_layout)
    host.backup(target, [0, 1], [3, 4])
    for part in host.parts:
        payload = part.payload(3)
        assert len(payload) == part.payload_bytes
        part.write(7, payload)
        assert part.payload(7) == payload
        if mem_layout == "page_first":
            assert bytes(part.view(7)) == payload
    target_part, draft_part = host.parts
    assert target_part.payload(4) != draft_part.payload(4)


def test_a_pool_without_a_draft_is_one_part_of_every_layer():
    target, _ = pools("packed")
    host = make_host_pool(target, PAGES, "page_first")
    assert isinstance(host, HostKVPool)
    (part,) = host.parts
    assert part.layers == range(TARGET_LAYERS) and part.payload_bytes == host.page_bytes and part.name == ""
