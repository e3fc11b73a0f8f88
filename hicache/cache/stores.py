"""The store objects a rank's storage tier reads and writes: the configured backend under this model's
namespace (its keys and headers name the model, dtype, page size, row layout and rank), and one more
namespace per other part of a page (a speculative draft's state), on the same backend. With
`--hicache-storage-key-scheme unified` the store is a UnifiedStore instead: objects named by the cells
of the grid they hold (hicache/storage/unified.py), the same for every compatible topology.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from hicache.config import HiCacheConfig
from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.mem.host_pool import PagePart
from hicache.storage import Namespace, StorageBackend, UnifiedStore, VerifiedStore
from hicache.storage.unified import Grid, KVGeometry, Shard, UnifiedNamespace

# The meaning of a stored page's bytes changed without any namespace field changing: since the TP sums
# are cut into fixed groups (hicache/model/kernels/tp_groups.py) every topology computes other bits than
# before (2), and since attention combines blocks of keys (hicache/model/kernels/key_blocks.py) a
# layer's KV past the first block's positions comes from other attention bits below it (3), so pages
# written by an earlier version are another namespace's, never served.
KV_SCHEMA_VERSION = 3


@dataclass(frozen=True)
class UnifiedPlacement:
    """What the unified layout needs of a rank: the model's KV geometry and the rank's global shard."""

    geometry: KVGeometry
    shard: Shard


def unified_namespace(cfg: HiCacheConfig, geometry: KVGeometry, model_identity: str, kv_dtype: str,
                      page_size: int) -> UnifiedNamespace:  # fmt: skip
    """The namespace every deployment of this model, dtype, page size and grid shares."""
    grid = Grid(
        geometry,
        cfg.hicache_storage_layer_partition or geometry.num_layers,
        cfg.hicache_storage_head_partition or 1,
    )
    return UnifiedNamespace(model_identity, kv_dtype, page_size, grid, schema_version=KV_SCHEMA_VERSION)

logger = logging.getLogger(__name__)


def open_store(
    cfg: HiCacheConfig, pool: DeviceKVPool, page_bytes: int, model_identity: str, rank_suffix: str,
    backend: StorageBackend, unified: UnifiedPlacement | None = None, writer: bool = True,
) -> VerifiedStore:  # fmt: skip
    """`backend` (the configured one, build.py) under this model's namespace."""
    kv_dtype = str(pool.dtype).removeprefix("torch.")
    namespace = Namespace(
        model=model_identity,
        kv_dtype=str(pool.dtype).removeprefix("torch."),
        page_size=pool.page_size,
        layout=f"page_rows:{pool.layout.row_numel}x{pool.num_layers}",
        rank=rank_suffix,
        schema_version=KV_SCHEMA_VERSION,
    )
    if unified is None:
        return VerifiedStore(backend, namespace, payload_bytes=page_bytes)
    uns = unified_namespace(cfg, unified.geometry, model_identity, kv_dtype, pool.page_size)
    store = UnifiedStore(backend, uns, unified.shard, pool.dtype.itemsize, writer=writer)
    if store.payload_bytes != page_bytes:
        raise ValueError(f"unified host page of {page_bytes} bytes, the grid's is {store.payload_bytes}")
    logger.info("unified storage layout: namespace %s, %d objects read per page", uns.digest, len(store.spans))
    return store


def part_store(target: VerifiedStore, part: PagePart) -> VerifiedStore:
    """The store of a page's other part (a draft's state), on the target's backend under its own
    namespace: its model, dtype, rows and part name, so its keys and headers are its own."""
    if isinstance(target, UnifiedStore):
        return unified_part_store(target, part)
    namespace = dataclasses.replace(
        target.namespace,
        model=part.identity or target.namespace.model,
        kv_dtype=part.dtype_name,
        layout=part.row_layout,
        part=part.name,
    )
    return VerifiedStore(target.backend, namespace, payload_bytes=part.payload_bytes)


def unified_part_store(target: UnifiedStore, part: PagePart) -> UnifiedStore:
    """Under the unified scheme, a page's other part (a draft's state) is a UnifiedStore of its own
    namespace: the part's model, dtype and name, the target's page size, and a grid of its own layers (one
    layer range) and its model's KV heads (its host pool's head groups; a row that is not K/V heads, e.g.
    a sidecar draft's, is one latent-like row). Its digest differs from the target's in the part name at
    least, so no object name of one is the other's. On several ranks (`part.shard`) the grid is the
    whole draft's, every rank names its cells alike, and a rank holding a copy another writes
    (`replica`) only reads: a store written at TP2 or PP2 serves TP1 and back, as the target's does."""
    layers = len(part.layers)
    shape = part.host.unified  # (groups, heads per group, head_dim) of a page_unified K/V pool
    shard = part.shard
    if shape is None:
        if shard is not None and len(shard.heads) != shard.num_kv_heads:
            raise UserError(
                f"the speculative draft {part.identity}'s rows are not K/V heads alone and it is sharded over TP: "
                "--hicache-storage-key-scheme unified cannot name its cells by heads; use rank-suffix keys"
            )
        geometry, per, heads = KVGeometry(layers, 1, part.host.row, latent=True), 0, range(1)
    else:
        groups, per, dim = shape
        geometry = KVGeometry(layers, shard.num_kv_heads if shard else groups * per, dim)
        heads = shard.heads if shard else range(groups * per)
    ns = UnifiedNamespace(part.identity or target.unified.model, part.dtype_name, target.unified.page_size,
                          Grid(geometry, layers, per), schema_version=KV_SCHEMA_VERSION, part=part.name)  # fmt: skip
    writer = target.writer and not (shard and shard.replica)
    store = UnifiedStore(target.backend, ns, Shard(range(layers), heads), part.host.dtype.itemsize, writer=writer)
    if store.payload_bytes != part.payload_bytes:
        raise ValueError(f"{part.name} part of {part.payload_bytes} bytes a page, its grid's is {store.payload_bytes}")
    logger.info("unified storage layout, %s part: namespace %s", part.name, ns.digest)
    return store
