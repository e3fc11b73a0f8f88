"""The KV handle's rollback of both models, and the draft layout's start-up check: the pure parts of
speculative decoding, without a model."""

import pytest
import torch

from hicache.cache.api import KVHandle, KVState
from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVComponent, KVLayout
from hicache.spec.draft_state import KVGeometry, choose_layout


def ready_handle(pages: int = 4, page_size: int = 4, draft: bool = True) -> KVHandle:
    handle = KVHandle(1, [1] * 8, "", page_size, draft_len=0 if draft else None)
    handle.state = KVState.READY
    handle.table.append(range(pages))
    return handle


def test_truncate_rolls_back_the_draft_with_the_target():
    h = ready_handle()
    h.advance(8)
    h.advance_draft(11)  # proposals ran ahead of the target
    assert h.valid_len == 8
    h.advance(12)  # the verify rows
    h.truncate(10)  # two rejected
    assert (h.kv_len, h.draft_len, h.valid_len) == (10, 10, 10)
    h.advance_draft(10)
    with pytest.raises(ValueError):
        h.advance_draft(9)  # back
    with pytest.raises(ValueError):
        h.advance_draft(17)  # beyond its pages


def test_a_handle_without_a_draft_has_no_draft_length():
    h = ready_handle(draft=False)
    h.advance(6)
    h.truncate(5)
    assert h.draft_len is None and h.valid_len == 5
    with pytest.raises(ValueError):
        h.advance_draft(6)


def geometry(layout: KVLayout, dtype=torch.float32, page_size: int = 16) -> KVGeometry:
    return KVGeometry.of(DeviceKVPool(layout, 1, 1, page_size, dtype, torch.device("cpu")))


TARGET = KVLayout.mha(2, 32)
WITH_STATE = KVLayout(TARGET.components + (KVComponent("shift", (8,)),))


def test_auto_packs_a_compatible_draft_and_takes_a_sidecar_otherwise():
    assert choose_layout("auto", geometry(TARGET), geometry(TARGET)) == "packed"
    assert choose_layout("auto", geometry(WITH_STATE), geometry(TARGET)) == "sidecar"
    assert choose_layout("sidecar", geometry(TARGET), geometry(TARGET)) == "sidecar"


@pytest.mark.parametrize(
    "draft,field",
    [
        (geometry(WITH_STATE), "row shape"),
        (geometry(KVLayout.mha(1, 32)), "row shape"),
        (geometry(TARGET, torch.bfloat16), "dtype"),
        (geometry(TARGET, page_size=8), "token indexing"),
    ],
)
def test_packed_is_refused_naming_the_field_that_differs(draft, field):
    with pytest.raises(UserError, match=f"--hicache-draft-layout packed: the draft's {field}"):
        choose_layout("packed", draft, geometry(TARGET))
