"""Resolves a `--model` argument (tiny, tiny-mla, tiny-hybrid, smollm2, a .gguf file or a local Hugging Face
directory) to a LoadedModel."""

from __future__ import annotations

import os

from hicache.errors import UserError
from hicache.model.config import LoadedModel


def load_model(name: str, keep_codes: bool = True) -> LoadedModel:
    """`keep_codes`: a quantized checkpoint's integer codes too (`LoadedModel.quantized`), for
    `--quantization` other than none."""
    if name == "tiny":
        from hicache.model.families.tiny import load_tiny

        return load_tiny()
    if name == "tiny-mla":
        from hicache.model.families.tiny_mla import load_tiny_mla

        return load_tiny_mla()
    if name == "tiny-hybrid":
        from hicache.model.families.tiny_hybrid import load_tiny_hybrid

        return load_tiny_hybrid()
    if name == "smollm2":
        from hicache.model.loading.gguf_loader import load_gguf, smollm2_path

        return load_gguf(smollm2_path(), name, keep_codes)
    if os.path.isdir(name):
        from hicache.model.loading.hf_loader import load_hf_dir

        return load_hf_dir(name, name)
    if name.endswith(".gguf") and os.path.isfile(name):
        from hicache.model.loading.gguf_loader import load_gguf

        return load_gguf(name, name, keep_codes)
    raise UserError(
        f"unknown model {name!r}: use tiny, tiny-mla, tiny-hybrid, smollm2, a .gguf file or a Hugging Face "
        "model directory"
    )
