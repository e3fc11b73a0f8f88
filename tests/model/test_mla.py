"""`tiny-mla` (hicache/model/families/mla.py): one latent row per token and layer in its own KV layout, the
start-up batch-invariance self-check passes on it, and its TP ranks hold the same latent bytes (which
is what lets them shard its pages)."""

import torch

from hicache.config import EngineConfig
from hicache.model.build import build_decoder
from hicache.model.families.tiny_mla import TINY_MLA_CONFIG
from hicache.model.loading.loader import load_model
from hicache.parallel.parallel import ParallelContext


def test_tiny_mla_has_a_latent_kv_layout_and_passes_the_self_check():
    loaded = load_model("tiny-mla")
    cfg = EngineConfig(model="tiny-mla")
    model = build_decoder(loaded, ParallelContext(), cfg.resolved_dtype(), torch.device("cpu"))
    assert [c.name for c in model.kv_layout.components] == ["latent", "rope"]
    assert model.kv_layout.row_numel == TINY_MLA_CONFIG.kv_lora_rank + TINY_MLA_CONFIG.qk_rope_head_dim
    assert model.replicated_over_tp and model.kv_sharding.size == 1
    assert model.invariance is not None and model.invariance.verified, model.invariance
    assert set(model.linear_plans()) >= {"q_proj", "kv_a_proj", "kv_b_proj", "o_proj"}
