"""`hicache generate --json` with a draft, as a user runs it: the same tokens as without one, each row
with the draft's proposed and accepted tokens; a draft the cache cannot hold as asked is one line and
exit 2, naming the field."""

import json

import pytest

from tests.test_cli import hicache

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

SPEC = ("--speculative-algorithm", "draft", "--speculative-draft-model")


def test_generate_json_rows_carry_the_acceptance_and_the_targets_tokens(tmp_path):
    history = "A long shared history for every prompt. " * 8
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(history + q) + "\n" for q in ("first?", "second?")))
    args = ("generate", "--model", "tiny", "--prompts-file", str(prompts), "--max-new-tokens", "16", "--json")
    plain = hicache(*args)
    spec = hicache(*args, *SPEC, "tiny-draft-packed", "--enable-hierarchical-cache")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    plain_rows = [json.loads(line) for line in plain.stdout.splitlines()]
    spec_rows = [json.loads(line) for line in spec.stdout.splitlines()]
    assert [r["token_ids"] for r in spec_rows] == [r["token_ids"] for r in plain_rows]
    assert all("spec_proposed_tokens" not in r for r in plain_rows)
    for row in spec_rows:
        assert 0 <= row["spec_accepted_tokens"] <= row["spec_proposed_tokens"] and row["spec_proposed_tokens"] > 0
    assert spec_rows[1]["cached_tokens"] > 0


def test_a_packed_layout_the_draft_cannot_have_is_one_line_and_exit_2():
    proc = hicache("generate", "--model", "tiny", "--prompt", "x", *SPEC, "tiny-draft-sidecar",
                   "--enable-hierarchical-cache", "--hicache-draft-layout", "packed")  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--hicache-draft-layout packed: the draft's row shape" in lines[0]
