"""Tiny checkpoints of each model family, made by transformers itself (its config class, weights drawn with
a fixed seed, `save_pretrained`), and transformers' own logits for them: the reference hicache's families
are checked against (tests/model/test_model_families.py). Nothing is downloaded; a checkpoint takes well
under a second."""

from __future__ import annotations

import pathlib

import torch
import transformers

from tests.model.test_hf_loader import _tokenizer

# Widths the native kernels take (multiples of 8), head_dim apart from hidden / heads, three layers so
# Gemma 3's sliding and global layers both occur, a window well under the prompts.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
WINDOW = 16
GEMMA = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24)

FAMILIES: dict[str, tuple[type, dict]] = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24)),
    "phi3": (transformers.Phi3Config, {}),
    # Gemma 2 without attention soft-capping (which hicache refuses), with its final logit soft-capping.
    "gemma2": (transformers.Gemma2Config, dict(GEMMA, attn_logit_softcapping=None, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig,
               dict(GEMMA, layer_types=["sliding_attention", "sliding_attention", "full_attention"])),  # fmt: skip
}


def save_checkpoint(family: str, root: pathlib.Path, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    """`family`'s tiny checkpoint in `root` (weights, config, tokenizer); returns transformers' model of it."""
    config_class, extra = FAMILIES[family]
    tokenizer = _tokenizer()
    vocab = tokenizer.get_vocab_size() + 4
    ids = {name: tokenizer.token_to_id(t) for name, t in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<unk>"))}
    config = config_class(**SHAPE, **{**extra, **overrides}, vocab_size=vocab, bos_token_id=ids["bos"],
                          eos_token_id=ids["eos"], pad_token_id=ids["pad"], attn_implementation="eager")  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger than transformers' init, so logits tell tokens apart by whole nats
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.save_pretrained(root)
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return model


def reference_logprobs(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(ids), vocab] of the token after each of `ids`, in float32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
