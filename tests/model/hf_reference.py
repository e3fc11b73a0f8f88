"""Tiny checkpoints of each model family, made by transformers itself (its config class, weights drawn with
a fixed seed, `save_pretrained`), and transformers' own logits for them: the reference hicache's families
are checked against (tests/model/test_model_families.py), and the GGUF llama.cpp's converter makes of each.
Nothing is downloaded; a checkpoint takes well under a second."""

from __future__ import annotations

import json
import pathlib

import gguf
import torch
import transformers

from tests.model.test_hf_loader import _tokenizer

# Widths the native kernels take (multiples of 8), head_dim apart from hidden / heads, three layers so
# Gemma 3's sliding and global layers both occur, a window well under the prompts.
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
WINDOW = 16
GEMMA = {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24}

FAMILIES: dict[str, tuple[type, dict]] = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 24}),
    "phi3": (transformers.Phi3Config, {}),
    # Gemma 2 without attention soft-capping (which hicache refuses), with its final logit soft-capping.
    "gemma2": (transformers.Gemma2Config, {**GEMMA, "attn_logit_softcapping": None, "final_logit_softcapping": 3.0}),
    "gemma3": (
        transformers.Gemma3TextConfig,
        {**GEMMA, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    ),
}


def save_checkpoint(
    family: str, root: pathlib.Path, seed: int = 0, **overrides: object
) -> transformers.PreTrainedModel:
    """`family`'s tiny checkpoint in `root` (weights, config, tokenizer); returns transformers' model of it."""
    config_class, extra = FAMILIES[family]
    tokenizer = _tokenizer()
    vocab = tokenizer.get_vocab_size() + 4
    ids = {name: tokenizer.token_to_id(t) for name, t in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<unk>"))}
    config = config_class(**{**SHAPE, **extra, **overrides}, vocab_size=vocab, bos_token_id=ids["bos"],
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


def save_gguf(family: str, model: transformers.PreTrainedModel, path: pathlib.Path,
              quantize: tuple[str, ...] = ()) -> None:  # fmt: skip
    """`model` as llama.cpp's converter writes it: tensor names from gguf's own map for the architecture,
    `{arch}.*` metadata, Gemma's norms shifted by one, no q/k permutation (only llama's converter permutes),
    a tied output head left out, the tokenizer's BPE vocabulary and merges; tensors whose names contain
    one of `quantize` in Q8_0 (the others float32)."""
    config = model.config
    arch = {"qwen2": "QWEN2", "qwen3": "QWEN3", "phi3": "PHI3", "gemma2": "GEMMA2", "gemma3": "GEMMA3"}[family]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters.get("full_attention", config.rope_parameters)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    tokenizer = json.loads(_tokenizer().to_str())["model"]
    tokens = sorted(tokenizer["vocab"], key=tokenizer["vocab"].get)
    tokens += [f"[PAD{i}]" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.float() + (1.0 if family.startswith("gemma") and name.endswith("norm.weight") else 0.0)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if any(q in name for q in quantize):
            codes = gguf.quants.quantize(data.numpy(), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, codes, raw_shape=codes.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
