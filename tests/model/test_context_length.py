"""`--context-length` (hicache/engine/build.py `context_length`): tiny-mla and the tiny drafts accept up to
1,048,576 positions as tiny does (tests/test_cli.py runs tiny there); more than a model supports is refused,
not silently shortened; tiny answers past the 4,096 positions it used to stop at with the cache as without."""

from __future__ import annotations

import pathlib

import pytest

from hicache import Engine, SamplingParams
from hicache.config import EngineConfig
from hicache.engine.build import context_length
from hicache.errors import UserError
from hicache.model.loading.draft import load_draft
from hicache.model.loading.loader import load_model
from tests.model.test_hf_loader import write_hf_dir

MILLION = 1 << 20


def test_tiny_mla_and_the_tiny_drafts_accept_a_million_positions_and_no_more() -> None:
    tiny = load_model("tiny")
    drafts = [load_draft(name, tiny).config for name in ("tiny-draft-packed", "tiny-draft-sidecar")]
    for config in [load_model("tiny-mla").config, *drafts]:
        assert context_length(EngineConfig(), config) == 4096
        assert context_length(EngineConfig(context_length=MILLION), config) == MILLION
        with pytest.raises(UserError, match=f"--context-length {MILLION + 1} is more than the model's {MILLION}"):
            context_length(EngineConfig(context_length=MILLION + 1), config)


def test_a_checkpoint_refuses_a_context_longer_than_it_supports(tmp_path: pathlib.Path) -> None:
    write_hf_dir(tmp_path / "m", max_position_embeddings=128)
    with pytest.raises(UserError, match="--context-length 256 is more than the model's 128 positions"):
        Engine(model=str(tmp_path / "m"), context_length=256)
    with Engine(model=str(tmp_path / "m"), context_length=64, max_total_tokens=256) as engine:
        assert engine.context_length == 64


@pytest.mark.slow
def test_tiny_generates_past_4096_positions_with_the_cache_as_without() -> None:
    """A 4,200-token prompt reaches positions tiny could not before; with the cache its prefix comes from an
    earlier request, and the answer is the cache-off one."""
    prompt = [(i * 37) % 256 for i in range(4200)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Engine(model="tiny", context_length=8192, max_total_tokens=8192) as engine:
        engine.generate([prompt[:-8]], SamplingParams(max_new_tokens=1))
        cached = engine.generate([prompt], params)[0]
    assert cached.cached_tokens >= 4096
    with Engine(model="tiny", context_length=8192, max_total_tokens=8192, disable_radix_cache=True) as engine:
        assert engine.generate([prompt], params)[0].token_ids == cached.token_ids
