"""`hicache generate` as a user runs it: a real subprocess, JSON output, one-line errors with exit 2. A
subprocess proves the wiring (exit status, stderr) once per kind of run; the other bad inputs go through
the same `main()` in this process, which saves the 4 s of starting Python and torch each."""

import json
import subprocess
import sys

import pytest

from hicache.cli import main
from tests.model.test_hf_loader import write_hf_dir


def hicache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache", *args], capture_output=True, text=True, timeout=300)


def error_line(capsys, *args: str) -> str:
    """`hicache ARGS` run in this process: it must exit 2 with one line on stderr, returned."""
    code = main(list(args))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.slow
def test_bad_input_in_a_real_process_is_one_line_and_exit_2():
    proc = hicache("generate", "--model", "no-such-model", "--prompt", "x")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "unknown model" in lines[0], proc.stderr


@pytest.mark.slow
def test_prompts_file_runs_in_order_and_hits_cache(tmp_path):
    history = "A long shared history for every prompt. " * 10
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(history + q) + "\n" for q in ("first?", "second?", "third?")))
    proc = hicache("generate", "--model", "tiny", "--prompts-file", str(prompts), "--max-new-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert {"text", "token_ids", "prompt_tokens", "cached_tokens", "cached_tokens_by_tier"} <= row.keys()
        assert sum(row["cached_tokens_by_tier"].values()) == row["cached_tokens"]
    assert rows[0]["cached_tokens"] == 0
    assert rows[1]["cached_tokens"] >= 384 and rows[2]["cached_tokens"] >= 384  # the shared history, in pages


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "no-such-model", "--prompt", "x"], "unknown model"),
        (["--model", "tiny", "--prompts-file", "/no/such/file"], "cannot read"),
        (["--model", "tiny", "--prompt", "a" * 5000], "context length"),
        (["--model", "tiny", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be positive"),
        (["--model", "tiny", "--prompt", "x", "--page-size", "12"], "power of two"),
        (["--model", "tiny"], "required"),
        (
            [
                "--model",
                "tiny",
                "--prompt",
                "x",
                "--enable-hierarchical-cache",
                "--hicache-storage-backend",
                "file",
                "--hicache-storage-idle-ttl",
                "60",
            ],
            "applies to --hicache-storage-backend redis only",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert message in error_line(capsys, "generate", *args)


def test_a_prompt_past_a_1m_context_is_one_line_and_exit_2(capsys, tmp_path):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps("a" * (1 << 20)) + "\n")
    line = error_line(
        capsys, "generate", "--model", "tiny", "--context-length", "1048576", "--prompts-file", str(prompts)
    )
    assert "context length of 1048576 tokens" in line


def test_an_unknown_rope_scaling_is_one_line_and_exit_2(capsys, tmp_path):
    write_hf_dir(tmp_path / "m", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "rope scaling 'dynamic' is not supported" in error_line(
        capsys, "generate", "--model", str(tmp_path / "m"), "--prompt", "x"
    )
