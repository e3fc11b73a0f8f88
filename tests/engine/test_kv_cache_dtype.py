"""--kv-cache-dtype bfloat16 under float32 activations: every tier holds half the bytes a token, each K/V
row rounded once as it is written, so the cache still never changes an answer (a hit on any tier gives
the cache-off run's tokens with the same KV dtype); pages of another KV dtype are another namespace; what
the pool cannot hold in another dtype (an MLA latent, a hybrid's state, a draft, a CP gather) is refused
before any rank builds."""

from __future__ import annotations

import pytest
import torch

from hicache import Engine
from hicache.config import EngineConfig, HiCacheConfig, SpeculativeConfig
from hicache.errors import UserError
from tests.conversations import make_conversations, run_turns
from tests.parallel.workload import tier_totals, tokens

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

CONVS = make_conversations(num_groups=2, per_group=2, system_len=160, question_len=24)
TURNS, NEW, DEVICE_TOKENS = 3, 12, 512  # the working set is a few times the device pool


def _engine(kv: str, **kw) -> Engine:
    return Engine(model="tiny", dtype="float32", kv_cache_dtype=kv, max_total_tokens=DEVICE_TOKENS, **kw)


def _tiers(store) -> HiCacheConfig:
    return HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_storage_backend="file",
                         hicache_storage_dir=str(store), hicache_storage_prefetch_threshold=16)  # fmt: skip


def test_a_bf16_kv_cache_answers_as_its_cache_off_run_on_every_tier_at_half_the_bytes(tmp_path):
    with _engine("bfloat16", disable_radix_cache=True) as engine:
        reference = tokens(run_turns(engine, CONVS, TURNS, NEW))
    served = {}
    for run in ("host", "storage"):  # the second engine restarts on the first one's store
        with _engine("bfloat16", hicache=_tiers(tmp_path / "bf16")) as engine:
            scheduler = engine._runtime.scheduler
            kv = engine.config.resolved_kv_dtype()
            assert kv == scheduler.runner.pool.dtype == scheduler.cache.lower.host.host.dtype == torch.bfloat16
            turns = run_turns(engine, CONVS, TURNS, NEW)
            assert tokens(turns) == reference
            served[run] = tier_totals(turns)
            assert engine.flush_cache() and engine.leak_report() == []
    assert served["host"]["host"] > 0 and served["storage"]["storage"] > 0, served
    bf16_pages = _pages(tmp_path / "bf16")
    with _engine("float32", hicache=_tiers(tmp_path / "bf16")) as engine:  # the same store, float32 KV
        turns = run_turns(engine, CONVS, 1, NEW)
        assert tier_totals(turns)["storage"] == 0  # another namespace: the bf16 pages are not its rows
    with _engine("float32", hicache=_tiers(tmp_path / "f32")) as engine:
        run_turns(engine, CONVS, TURNS, NEW)
    f32_pages = _pages(tmp_path / "f32")
    assert f32_pages.keys() == bf16_pages.keys()  # the same pages (named by tokens, less the namespace)
    bf16, f32 = sum(bf16_pages.values()), sum(f32_pages.values())
    assert 0.45 < bf16 / f32 < 0.55, (bf16, f32)  # at half the bytes, headers aside


def _pages(store) -> dict[str, int]:
    """Each stored object's size by its page hash (its name less the namespace digest)."""
    return {p.name.split("_")[0]: p.stat().st_size for p in store.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"model": "tiny-mla"}, "an MLA latent"),
        ({"model": "tiny-hybrid"}, "a hybrid's recurrent state"),
        ({"speculative": SpeculativeConfig("draft", "tiny-draft", 2)}, "a speculative draft"),
        ({"dtype": "bfloat16", "kv_cache_dtype": "float32"}, "bfloat16 under float32 only"),
    ],
)
def test_what_a_bf16_pool_cannot_hold_is_refused_in_one_line(overrides, says):
    cfg = EngineConfig(model="tiny", dtype="float32", kv_cache_dtype="bfloat16")
    with pytest.raises(UserError, match=says):
        Engine(cfg, **overrides)


def test_a_kv_cache_dtype_that_is_not_one_is_refused():
    with pytest.raises(UserError, match="--kv-cache-dtype must be auto, float32 or bfloat16"):
        EngineConfig(kv_cache_dtype="fp8")
