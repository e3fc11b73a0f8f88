"""`--speculative-algorithm ngram` flags a server cannot run with: `hicache serve` says so in one line and
exits 2 before loading anything; the same checks hold for the configuration built in code."""

import pytest

from hicache.config import SpeculativeConfig
from hicache.errors import UserError
from tests.test_cli import hicache

NGRAM = ("serve", "--model", "tiny", "--speculative-algorithm", "ngram")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["--speculative-draft-model", "tiny-draft-packed"], "ngram takes no --speculative-draft-model"),
        (["--speculative-ngram-min-match-window-size", "4", "--speculative-ngram-max-match-window-size", "3"],
         "--speculative-ngram-max-match-window-size must be >= the min window (4), got 3"),
    ],
)  # fmt: skip
def test_serve_refuses_in_one_line_with_exit_2(args, message):
    proc = hicache(*NGRAM, *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"speculative_ngram_min_match_window_size": 0}, "min-match-window-size must be >= 1, got 0"),
        ({"speculative_ngram_min_match_window_size": 3, "speculative_ngram_max_match_window_size": 2}, "got 2"),
        ({"speculative_num_draft_tokens": 0}, "--speculative-num-draft-tokens must be in 1..16"),
        ({"speculative_draft_model": "tiny-draft-packed"}, "ngram takes no --speculative-draft-model"),
    ],
)
def test_the_configuration_refuses_the_same(kw, message):
    with pytest.raises(UserError, match=message):
        SpeculativeConfig("ngram", **kw)


def test_ngram_has_no_draft_model():
    spec = SpeculativeConfig("ngram")
    assert spec.enabled and not spec.has_draft_model
