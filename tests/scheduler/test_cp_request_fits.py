"""What the engine front refuses as too large under context parallelism (check_request_fits): a
request's pages are sharded over the CP ranks, so it fits when its tightest owner class fits one rank's
pool (and the CP gather's scratch), not when its logical page count does. The front decides from the
configuration alone; an empty engine's own admission, counting class by class from any rotation base,
must agree with it, or a request it lets through could wait forever."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.device_tier import DeviceTier
from hicache.config import EngineConfig, ParallelConfig
from hicache.errors import RequestTooLargeError
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.kv_layout import KVLayout
from hicache.scheduler.scheduler import check_request_fits

NO_CONTEXT_LIMIT = 1 << 30  # the context length is checked before the pages; not what these tests vary


def refusal(cfg: EngineConfig, prompt_len: int, max_new_tokens: int) -> str | None:
    """The front's refusal of the request, or None where it lets it through."""
    try:
        check_request_fits(cfg, NO_CONTEXT_LIMIT, prompt_len, max_new_tokens)
    except RequestTooLargeError as e:
        return str(e)
    return None


def empty_engine_admits(cfg: EngineConfig, pages: int, rotation: int) -> bool:
    """Whether an engine's admission, with nothing else cached or running, finds room for `pages` pages
    starting on owner class `rotation`: the per-class checks of the pool and of the gather's scratch,
    on a pool built as every rank builds it (hicache/engine/build.py)."""
    shards = cfg.parallel.cp_size
    gather = cfg.cp_gather_pages if shards > 1 else None
    pool = DeviceKVPool(KVLayout.mha(1, 1), 1, cfg.num_pages, cfg.page_size, torch.float32, torch.device("cpu"),
                        shards, 0, gather)  # fmt: skip
    device = DeviceTier(pool)
    return device.budget.room(rotation, 0, pages)  # nothing is promised yet


@settings(max_examples=400, deadline=None)
@given(
    shards=st.integers(1, 4),
    page_size=st.sampled_from([1, 2, 4, 16]),
    local_pages=st.integers(2, 40),
    prompt_len=st.integers(1, 1500),
    max_new_tokens=st.integers(1, 200),
    rotation=st.integers(0, 3),
    gather_tokens=st.integers(0, 400),
)
def test_the_front_admits_exactly_what_fits_in_the_tightest_owner_class(
    shards, page_size, local_pages, prompt_len, max_new_tokens, rotation, gather_tokens
):
    cfg = EngineConfig(
        page_size=page_size, max_total_tokens=local_pages * page_size,
        parallel=ParallelConfig(cp_size=shards, cp_gather_tokens=gather_tokens),
    )  # fmt: skip
    pages = -(-(prompt_len + max_new_tokens) // page_size)
    rotation %= shards
    tightest = max(Counter((rotation + i) % shards for i in range(pages)).values())
    capacity = local_pages - 1 if shards > 1 else local_pages  # a sharded rank's page 0 pads its gathers
    gather = cfg.cp_gather_pages if shards > 1 else None
    fits = tightest <= capacity and (gather is None or tightest <= gather)
    refused = refusal(cfg, prompt_len, max_new_tokens)
    assert (refused is None) == fits, (tightest, capacity, gather, refused)
    assert (refused is None) == empty_engine_admits(cfg, pages, rotation), refused
    if refused is not None and shards > 1:
        assert f"needs up to {tightest} KV pages on each of the {shards} CP ranks ({pages} in all)" in refused
    elif refused is not None:
        assert f"needs {pages} KV pages but the pool has {local_pages}" in refused


def test_the_issues_prompt_of_65_pages_fits_two_ranks_of_64():
    cfg = EngineConfig(max_total_tokens=1024, parallel=ParallelConfig(cp_size=2))
    assert refusal(cfg, 1019, 21) is None  # 65 pages: 33 on one rank, 32 on the other
    alone = EngineConfig(max_total_tokens=1024)
    assert refusal(alone, 1019, 21) == (
        "prompt (1019 tokens) plus max new tokens (21) needs 65 KV pages but the pool has 64 (raise --max-total-tokens)"
    )


def test_a_request_beyond_the_cp_gather_is_refused_naming_the_flag():
    cfg = EngineConfig(max_total_tokens=1024, parallel=ParallelConfig(cp_size=2, cp_gather_tokens=512))
    assert refusal(cfg, 1000, 24) is None  # 64 pages: 32 per rank, what the gather holds
    with pytest.raises(RequestTooLargeError, match=r"on each of the 2 CP ranks \(65 in all\) but the CP gather "
                                                    r"holds 32 per rank \(raise --cp-gather-tokens\)"):  # fmt: skip
        check_request_fits(cfg, NO_CONTEXT_LIMIT, 1000, 25)
