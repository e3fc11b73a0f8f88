"""The store objects a rank's storage tier reads and writes: the configured backend under this model's
namespace (its keys and headers name the model, dtype, page size, row layout and rank), and one more
namespace per other part of a page (a speculative draft's state), on the same backend.
"""

from __future__ import annotations

import dataclasses
import logging

from hicache.config import DebugConfig, HiCacheConfig
from hicache.debug.faults import FlakyReads
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_pool import PagePart
from hicache.storage import Namespace, VerifiedStore, make_backend

logger = logging.getLogger(__name__)


def open_store(
    cfg: HiCacheConfig, pool: DeviceKVPool, page_bytes: int, model_identity: str, rank_suffix: str,
    debug: DebugConfig, rank: int,
) -> VerifiedStore:  # fmt: skip
    """The configured backend under this model's namespace (with fault injection where asked)."""
    namespace = Namespace(
        model=model_identity,
        kv_dtype=str(pool.dtype).removeprefix("torch."),
        page_size=pool.page_size,
        layout=f"page_rows:{pool.layout.row_numel}x{pool.num_layers}",
        rank=rank_suffix,
    )
    backend = make_backend(
        cfg.hicache_storage_backend, cfg.hicache_storage_dir, cfg.hicache_storage_url, cfg.hicache_storage_max_bytes
    )
    if debug.debug_storage_fail_rate > 0 and rank == debug.debug_storage_fail_rank:
        backend = FlakyReads(backend, debug.debug_storage_fail_rate, seed=rank)
        rate = 100 * debug.debug_storage_fail_rate
        logger.warning("rank %d fails %.0f%% of storage reads (fault injection)", rank, rate)
    return VerifiedStore(backend, namespace, payload_bytes=page_bytes)


def part_store(target: VerifiedStore, part: PagePart) -> VerifiedStore:
    """The store of a page's other part (a draft's state), on the target's backend under its own
    namespace: its model, dtype, rows and part name, so its keys and headers are its own."""
    namespace = dataclasses.replace(
        target.namespace,
        model=part.identity or target.namespace.model,
        kv_dtype=part.dtype_name,
        layout=part.row_layout,
        part=part.name,
    )
    return VerifiedStore(target.backend, namespace, payload_bytes=part.payload_bytes)
