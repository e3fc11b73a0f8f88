"""The bytes of one page of an engine's KV, for tests that size a store's cap or count bytes moved: from
the model's geometry and the dtype the engine's `--dtype` resolves to on this machine (`auto`: bf16 or
float32 by CPU, or as `HICACHE_CPU_BF16` says), never from the CPU a test was written on
(docs/DESIGN.md, "Conventions")."""

from __future__ import annotations

import torch

from hicache.config import EngineConfig
from hicache.engine.build import activation_dtype
from hicache.model.loading.loader import load_model
from hicache.storage.codec import HEADER_SIZE


def engine_dtype(cfg: EngineConfig) -> torch.dtype:
    """The KV dtype an engine of `cfg` runs here (what `load_engine_model` resolves `--dtype` to)."""
    return activation_dtype(cfg, load_model(cfg.model, keep_codes=cfg.quantization != "none"))


def stored_page_bytes(cfg: EngineConfig) -> int:
    """One page's object in a store, for a one-rank engine of a Llama-family `cfg.model`: the envelope's
    header, then K and V of every layer."""
    c = load_model(cfg.model, keep_codes=False).config
    return HEADER_SIZE + cfg.page_size * 2 * c.num_layers * c.num_kv_heads * c.head_dim * engine_dtype(cfg).itemsize
