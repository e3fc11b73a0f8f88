"""Ways ranks come up and go down: the engine front's own processes, torchrun, two "nodes" on loopback;
and a rank that dies fails the engine and makes `hicache serve` exit non-zero, never hang."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from hicache import Engine, SamplingParams
from hicache.config import ParallelConfig
from hicache.engine.launch import free_port
from tests.server.server_harness import REPO, spawn_server

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

PROMPTS = ["The cache keeps the history; " * 12, "The cache keeps the history; " * 12 + "and the answer?"]
NEW = 8


@pytest.fixture(scope="module")
def single_rank_tokens():
    with Engine(model="tiny", disable_radix_cache=True) as engine:
        return [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]


def generate_args(prompts_file, *extra: str) -> list[str]:
    return [
        "-m", "hicache", "generate", "--model", "tiny", "--prompts-file", str(prompts_file),
        "--max-new-tokens", str(NEW), "--json", "--pp-size", "2", *extra,
    ]  # fmt: skip


def write_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def json_tokens(stdout: str) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in stdout.splitlines() if line.startswith("{")]


def test_generate_under_torchrun(single_rank_tokens, tmp_path):
    prompts = write_prompts(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += generate_args(prompts)[1:]  # torchrun takes the module after its own flags: -m hicache ...
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json_tokens(done.stdout) == single_rank_tokens


def test_generate_over_two_nodes(single_rank_tokens, tmp_path):
    """--nnodes 2: node 0 runs the front and pipeline stage 0, node 1 runs stage 1."""
    prompts = write_prompts(tmp_path)
    addr = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                *generate_args(prompts, "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert json_tokens(outs[0][0]) == single_rank_tokens
    assert outs[1][0] == ""  # node 1 serves nothing


def rank_pids(parent: int) -> list[int]:
    """The rank processes `parent` spawned (multiprocessing spawn children), in start order."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


def test_engine_fails_every_request_when_a_rank_dies():
    with Engine(model="tiny", parallel=ParallelConfig(tp_size=2)) as engine:
        handles = [
            engine.submit([40 + i] * 200, SamplingParams(max_new_tokens=3000, ignore_eos=True)) for i in range(3)
        ]
        time.sleep(0.5)
        pids = rank_pids(os.getpid())
        assert len(pids) == 2
        started = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        results = [h.result() for h in handles]
        assert time.monotonic() - started < 10
        for r in results:
            assert r.finish_reason == "error" and r.error == "rank 1 was killed by SIGKILL"
        assert engine.fatal_error == "rank 1 was killed by SIGKILL"
        with pytest.raises(RuntimeError, match="the engine failed: rank 1 was killed"):
            engine.submit("anything")
        with pytest.raises(RuntimeError, match="the engine failed"):
            engine.flush_cache()


def test_serve_exits_non_zero_when_a_rank_dies(tmp_path):
    server = spawn_server(tmp_path, "--tp-size", "2")
    try:
        server.wait_healthy()
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        pids = rank_pids(server.proc.pid)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        log = server.log.read_text()
        assert "exiting: rank 0 was killed by SIGKILL" in log
        assert rank_pids(server.proc.pid) == []
    finally:
        server.stop()
