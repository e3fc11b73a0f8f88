"""The Hugging Face directory loader on a tiny Llama directory built here: weights, config, tokenizer
and chat template round-trip; unsupported or incomplete directories are user errors."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from hicache.errors import UserError
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.build import build_decoder
from hicache.model.chat import ChatTemplate
from hicache.model.config import ModelConfig
from hicache.model.families.hybrid import HybridConfig
from hicache.model.kernels.invariance import feed
from hicache.model.loading.hf_loader import load_hf_dir
from hicache.parallel.parallel import ParallelContext

SPECIALS = ["<unk>", "<s>", "</s>", "<|eot|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 24, 4, 2, 8, 2


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = BpeTrainer(vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return tokenizer


def _weights(vocab: int, tied: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN), "model.norm.weight": torch.randn(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = torch.randn(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.randn(HIDDEN)
        weights[p + "post_attention_layernorm.weight"] = torch.randn(HIDDEN)
        weights[p + "self_attn.q_proj.weight"] = torch.randn(HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.k_proj.weight"] = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.v_proj.weight"] = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.o_proj.weight"] = torch.randn(HIDDEN, HEADS * HEAD_DIM)
        weights[p + "mlp.gate_proj.weight"] = torch.randn(FFN, HIDDEN)
        weights[p + "mlp.up_proj.weight"] = torch.randn(FFN, HIDDEN)
        weights[p + "mlp.down_proj.weight"] = torch.randn(HIDDEN, FFN)
    return {name: w.to(dtype) for name, w in weights.items()}


def write_hf_dir(
    root: pathlib.Path, *, tied: bool = False, dtype: torch.dtype = torch.float32, **config_overrides: object
) -> dict[str, torch.Tensor]:
    """A complete tiny Llama checkpoint directory; returns the weights it holds."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save(str(root / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size() + 4  # padded embedding, as real checkpoints often have
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,  # deliberately not hidden_size // num_attention_heads
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
    }
    config.update(config_overrides)
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE})
    )
    weights = _weights(vocab, tied, dtype)
    save_file(weights, str(root / "model.safetensors"))
    return weights


def test_round_trip(tmp_path: pathlib.Path) -> None:
    weights = write_hf_dir(tmp_path / "m")
    model = load_hf_dir(tmp_path / "m", "tiny-hf")
    c = model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (LAYERS, HIDDEN, FFN)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position) == (500000.0, 1e-5, 128)
    assert c.vocab_size == weights["model.embed_tokens.weight"].shape[0] and not c.tie_word_embeddings
    assert model.name == "tiny-hf" and re.fullmatch(r"[0-9a-f]{64}", model.identity)
    assert model.weights.keys() == weights.keys()
    for name, weight in weights.items():
        assert model.weights[name].dtype == torch.float32
        assert torch.equal(model.weights[name], weight), name


def test_tokenizer_and_chat_template(tmp_path: pathlib.Path) -> None:
    write_hf_dir(tmp_path / "m")
    tok = load_hf_dir(tmp_path / "m", "tiny-hf").tokenizer
    reference = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    assert tok.vocab_size == reference.get_vocab_size()
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 3)
    text = "the lazy dog jumps, über 42!"
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.chat_template == ChatTemplate(TEMPLATE, bos_token="<s>", eos_token="</s>")
    rendered = tok.chat_template.render([{"role": "user", "content": "the fox"}])
    assert rendered == "<s>[user] the fox<|eot|>[assistant] "
    ids = tok.encode(rendered)
    assert ids[0] == 1 and ids.count(3) == 1
    assert tok.decode(ids) == rendered


def test_tied_bf16_checkpoint(tmp_path: pathlib.Path) -> None:
    weights = write_hf_dir(tmp_path / "m", tied=True, dtype=torch.bfloat16)
    model = load_hf_dir(tmp_path / "m", "tiny-hf")
    assert model.config.tie_word_embeddings and "lm_head.weight" not in model.weights
    for name, weight in weights.items():
        assert model.weights[name].dtype == torch.float32
        assert torch.equal(model.weights[name], weight.float()), name


def test_transformers5_rope_parameters_and_jinja_template(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "m"
    write_hf_dir(root, rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (root / "chat_template.jinja").write_text(TEMPLATE)
    model = load_hf_dir(root, "m")
    assert model.config.rope_theta == 1234.0
    assert model.tokenizer.chat_template.source == TEMPLATE


def test_sharded_checkpoint(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "m"
    weights = write_hf_dir(root)
    (root / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, str(root / shard))
    index = {"weight_map": {n: shard for shard, shard_names in shards.items() for n in shard_names}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_hf_dir(root, "m")
    assert all(torch.equal(model.weights[n], w) for n, w in weights.items())
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="missing"):
        load_hf_dir(root, "m")


def test_identity_tracks_weights(tmp_path: pathlib.Path) -> None:
    write_hf_dir(tmp_path / "a")
    write_hf_dir(tmp_path / "b", tied=True)
    assert load_hf_dir(tmp_path / "a", "a").identity == load_hf_dir(tmp_path / "a", "a").identity
    assert load_hf_dir(tmp_path / "a", "a").identity != load_hf_dir(tmp_path / "b", "b").identity


@pytest.mark.parametrize("model_type", ["gpt2", "falcon", None])
def test_unsupported_model_type(tmp_path: pathlib.Path, model_type: str | None) -> None:
    write_hf_dir(tmp_path / "m", model_type=model_type)
    with pytest.raises(UserError, match=f"model_type {model_type!r} is not supported .supported: llama, mistral, qwen2"):
        load_hf_dir(tmp_path / "m", "m")


def test_refusals_name_their_reason(tmp_path: pathlib.Path) -> None:
    """What the decoder cannot compute is refused at load, in one line naming the family and the part."""
    cases = {
        "gemma3": ({"text_config": {}}, "model_type 'gemma3' is not supported \\(serve its text model"),
        "gemma2": ({"attn_logit_softcapping": 50.0}, "Gemma 2: attention logit soft-capping"),
        "phi3": ({"partial_rotary_factor": 0.75}, "Phi-3: partial rotary embeddings"),
        "llama": ({"attention_bias": True}, "output and MLP projections with biases are not supported"),
    }
    for model_type, (overrides, message) in cases.items():
        write_hf_dir(tmp_path / model_type, model_type=model_type, **overrides)
        with pytest.raises(UserError, match=message):
            load_hf_dir(tmp_path / model_type, "m")


@pytest.mark.parametrize(
    "scaling,message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope scaling 'dynamic' is not supported"),
        ({"type": "longrope", "factor": 2.0}, "rope scaling 'longrope' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "rope scaling 'llama3' lacks low_freq_factor"),
        ({"rope_type": "linear", "factor": "x"}, "rope scaling 'linear' is invalid"),
    ],
)
def test_unknown_or_incomplete_rope_scaling_refused(tmp_path: pathlib.Path, scaling: dict, message: str) -> None:
    write_hf_dir(tmp_path / "m", rope_scaling=scaling)
    with pytest.raises(UserError, match=message):
        load_hf_dir(tmp_path / "m", "m")


def test_missing_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_hf_dir(tmp_path / "absent", "absent")


@pytest.mark.parametrize(
    "missing,message",
    [
        ("config.json", "config.json not found"),
        ("model.safetensors", "no \\*.safetensors"),
        ("tokenizer.json", "tokenizer.json not found"),
    ],
)
def test_missing_files(tmp_path: pathlib.Path, missing: str, message: str) -> None:
    write_hf_dir(tmp_path / "m")
    (tmp_path / "m" / missing).unlink()
    with pytest.raises(UserError, match=message):
        load_hf_dir(tmp_path / "m", "m")


def test_wrong_shapes_and_corrupt_weights(tmp_path: pathlib.Path) -> None:
    write_hf_dir(tmp_path / "m", hidden_size=HIDDEN * 2)
    with pytest.raises(UserError, match="shape"):
        load_hf_dir(tmp_path / "m", "m")
    write_hf_dir(tmp_path / "n")
    (tmp_path / "n" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_hf_dir(tmp_path / "n", "n")


def test_sliding_layers_load_as_a_hybrid_that_attends_over_the_window(tmp_path: pathlib.Path) -> None:
    """`layer_types` with sliding layers: the context is not capped at the window, and the sliding layer
    attends over its last 8 keys: the first 8 tokens' logits are the full-attention model's, later ones not."""
    write_hf_dir(tmp_path / "m", layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    loaded = load_hf_dir(tmp_path / "m", "hf-hybrid")
    assert isinstance(loaded.config, HybridConfig) and loaded.family == "hybrid"
    assert loaded.config.layer_types == ("sliding_attention", "full_attention") and loaded.config.sliding_window == 8
    assert loaded.config.max_position == 128
    shape = {f.name: getattr(loaded.config, f.name) for f in dataclasses.fields(ModelConfig)}
    full = dataclasses.replace(loaded, config=ModelConfig(**shape), family="llama")
    inputs = torch.arange(20) % 200 + 5
    sliding, attending = (logits_of(model, inputs) for model in (loaded, full))
    assert torch.allclose(sliding[:8], attending[:8], atol=1e-4)
    assert not torch.allclose(sliding[8:], attending[8:], atol=1e-2)


def test_linear_attention_layers_from_a_checkpoint_are_refused(tmp_path: pathlib.Path) -> None:
    write_hf_dir(tmp_path / "m", layer_types=["linear_attention", "full_attention"], sliding_window=8)
    with pytest.raises(UserError, match="linear_attention layers are not supported from a checkpoint"):
        load_hf_dir(tmp_path / "m", "hf-hybrid")


def logits_of(loaded, inputs: torch.Tensor) -> torch.Tensor:
    model = build_decoder(loaded, ParallelContext(), torch.float32, torch.device("cpu"), invariant=False)
    pool = DeviceKVPool(model.kv_layout, model.num_local_layers, 4, 16, torch.float32, torch.device("cpu"))
    return feed(model, pool, inputs, [len(inputs)], 0)
