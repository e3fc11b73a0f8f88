"""Host pool copies: every page lands where it belongs, for both layouts, whether the pages form long
runs (one strided copy each) or are scattered (gather/scatter), and a page's storage payload
round-trips."""

import pytest
import torch

from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_pool import LAYOUTS, HostKVPool
from hicache.mem.kv_layout import KVLayout


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "device_pages,host_pages",
    [
        (list(range(2, 12)), list(range(5, 15))),
        ([9, 1, 4, 7, 0], [3, 12, 6, 0, 10]),
        ([3, 4, 5, 9, 10], [0, 1, 2, 7, 8]),
    ],
    ids=["runs", "scattered", "mixed"],
)
def test_backup_and_load_move_whole_pages(layout, device_pages, host_pages):
    device = DeviceKVPool(KVLayout.mha(2, 8), 3, 16, 4, torch.bfloat16, torch.device("cpu"))
    for buf in device.buffers:
        buf.normal_()
    original = [b.clone() for b in device.buffers]
    host = HostKVPool(device, 16, layout)
    host.backup(device, device_pages, host_pages)
    for buf in device.buffers:
        buf.zero_()
    targets = [(p + 3) % 16 for p in device_pages]  # loaded back into other device pages
    for layer in range(3):
        host.load_layer(device, layer, host_pages, targets)
    for layer in range(3):
        for src, dst in zip(device_pages, targets):
            assert torch.equal(device.pages_of_layer(layer)[dst], original[layer].view(16, -1)[src]), (
                f"layer {layer} page {src}->{dst}"
            )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_payload_round_trips(layout):
    device = DeviceKVPool(KVLayout.mha(2, 8), 3, 8, 4, torch.bfloat16, torch.device("cpu"))
    host = HostKVPool(device, 8, layout)
    host.buffer.normal_()
    payload = host.page_payload(5)
    assert len(payload) == host.page_bytes
    host.write_page(2, payload)
    assert host.page_payload(2) == payload
    if layout == "page_first":
        assert bytes(host.page_view(2)) == payload
