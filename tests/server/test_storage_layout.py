"""GET /hicache/storage_layout: the namespace and grid of the unified layout, enough for an external
router to compute the storage key of every object of a prompt (checked against the store itself)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from hicache import Engine, SamplingParams
from hicache.config import HiCacheConfig
from hicache.server.app import create_app
from hicache.storage import FileBackend, page_hashes


def test_storage_layout_names_the_objects_the_store_holds(tmp_path):
    hicache = HiCacheConfig(
        enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
        hicache_storage_key_scheme="unified", hicache_storage_layer_partition=3,
    )  # fmt: skip
    engine = Engine(model="tiny", hicache=hicache)
    with TestClient(create_app(engine, "tiny")) as client:
        layout = client.get("/hicache/storage_layout").json()
        assert layout["key_scheme"] == "unified"
        ns = layout["namespace"]
        assert ns["page_size"] == 16 and ns["kv_dtype"] and ns["replication"] == "heads-sharded"
        assert ns["grid"]["layer_ranges"] == [[0, 2], [3, 3]] and ns["grid"]["head_groups"] == 2
        assert layout["objects"] == ["L0-2_H0", "L3-3_H0", "L0-2_H1", "L3-3_H1"]
        prompt = [32 + i % 90 for i in range(64)]
        engine.generate([prompt], SamplingParams(max_new_tokens=2))
        assert engine.flush_cache()
    # What a router computes from the answer alone is what the store holds.
    store = FileBackend(tmp_path)
    first = page_hashes(prompt, ns["page_size"])[0].hex()
    keys = [layout["key_format"].format(page_hash=first, namespace_digest=layout["namespace_digest"], object=o)
            for o in layout["objects"]]  # fmt: skip
    assert store.exists_prefix(keys) == len(keys)


def test_rank_suffix_has_no_shared_namespace():
    engine = Engine(model="tiny")
    with TestClient(create_app(engine, "tiny")) as client:
        assert client.get("/hicache/storage_layout").json() == {
            "key_scheme": "rank-suffix", "storage_backend": None, "namespace_digest": None,
        }
