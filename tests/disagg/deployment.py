"""P/D deployments of real processes for the disagg tests: `hicache serve` prefill and decode servers
and a `hicache router` in front of them, on loopback ports the tests choose (so a server can be
restarted where the router expects it), each stopped by pid by the test that started it."""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

import httpx

from tests.disagg.pd import free_ports
from tests.server.server_harness import REPO, ServerProcess, metric, scrape


def spawn(log_dir: pathlib.Path, port: int, command: str, *args: str) -> ServerProcess:
    log = log_dir / f"{command}-{port}.log"
    cmd = [sys.executable, "-m", "hicache", "--log-level", "info", command, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "ab") as out:
        proc = subprocess.Popen([*cmd, *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log)


def serve(log_dir: pathlib.Path, port: int, *args: str) -> ServerProcess:
    return spawn(log_dir, port, "serve", "--model", "tiny", *args)


def prefill_args(bootstrap_port: int, *extra: str) -> tuple[str, ...]:
    return ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port), *extra)


DECODE_REUSE = ("--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache",
                "--enable-hierarchical-cache")  # fmt: skip
DECODE_PLAIN = ("--disaggregation-mode", "decode")


def router(
    log_dir: pathlib.Path, port: int, prefills: Sequence[str], decodes: Sequence[str], *extra: str
) -> ServerProcess:
    flags = [f for url in prefills for f in ("--prefill", url)] + [f for url in decodes for f in ("--decode", url)]
    return spawn(log_dir, port, "router", *flags, "--startup-timeout", "60", *extra)


@contextlib.contextmanager
def started(
    *servers: ServerProcess, wait: Callable[[ServerProcess], None] = ServerProcess.wait_healthy
) -> Iterator[None]:
    """Wait until every server is healthy (`wait`); stop them all at the end (signal all, then wait)."""
    try:
        for server in servers:
            wait(server)
        yield
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait_stopped()


def ports(n: int) -> list[int]:
    """n distinct free ports (each pick is random and free now: two picks can be the same port)."""
    chosen: list[int] = []
    while len(chosen) < n:
        if (port := free_ports(1)) not in chosen:
            chosen.append(port)
    return chosen


def decode_counters(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {
        "received": metric(samples, "hicache_disagg_received_tokens_total"),
        "bytes": metric(samples, "hicache_disagg_received_bytes_total"),
        **{
            tier: metric(samples, "hicache_disagg_decode_prefix_tokens_total", tier=tier)
            for tier in ("device", "host", "storage")
        },
    }


def complete(url: str, prompt: str | list[int], max_tokens: int = 12, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def conversations(seed: int, count: int = 2, turns: int = 3) -> list[tuple[int, list[int]]]:
    """(conversation, prompt) in the order interleaved clients send them: each conversation's next turn
    is its last prompt and 40 more tokens. Seeds name the conversations, so a test whose seed no other
    test of its decode server uses finds nothing of them on decode at its first turn."""
    histories = [[(7 * i + 31 * seed + 11 * c) % 250 for i in range(150)] for c in range(count)]
    out = []
    for turn in range(turns):
        for c in range(count):
            out.append((c, histories[c]))
            histories[c] = histories[c] + [40 + turn + c] * 40
    return out


def sent_bytes(prefill: str) -> float:
    return metric(scrape(prefill), "hicache_disagg_sent_bytes_total")


def check_turns(
    front: str, prefill: str, decode: str, prompts: Sequence[tuple[int, list[int]]],
    want: Callable[[list[int]], object], page: int = 16, model: str = "tiny",
) -> None:  # fmt: skip
    """Send `prompts` through the router at `front`: each answer's tokens and logprobs are `want(prompt)`'s
    (a single-rank cache-off server's), decode receives exactly the prompt after the prefix its own tree
    served, which covers the conversation's last prompt, and prefill sends exactly the bytes decode
    receives (every cell of every page crosses once, from its one owner)."""
    previous: dict[int, int] = {}  # each conversation's last prompt length, which decode's tree holds
    for n, (c, history) in enumerate(prompts):
        before, sent = decode_counters(decode), sent_bytes(prefill)
        got = complete(front, history, max_tokens=8, logprobs=2, model=model)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["logprobs"] == want(history), f"prompt {n} (conversation {c})"
        reused = got.json()["usage"]["prompt_tokens_details"]["decode_prefix_tokens"]
        after = decode_counters(decode)
        received = after["received"] - before["received"]
        assert received == len(history) - reused, "decode receives exactly the prompt after its prefix"
        assert reused >= previous.get(c, 0) // page * page, "a later turn receives only what follows the last"
        assert after["bytes"] - before["bytes"] == sent_bytes(prefill) - sent > 0, "each cell of each page once"
        previous[c] = len(history)


def reference(url: str, model: str = "tiny") -> Callable[[list[int]], object]:
    """What `check_turns` wants of a prompt: the tokens and logprobs of the server at `url`."""
    return lambda prompt: complete(url, prompt, max_tokens=8, logprobs=2, model=model).json()["choices"][0]["logprobs"]


def router_refusal(prefill: str, decode: str) -> str:
    """Start `hicache router` over one pair that it must refuse: its one-line error (exit code 2)."""
    cmd = [sys.executable, "-m", "hicache", "router", "--prefill", prefill, "--decode", decode,
           "--port", "0", "--startup-timeout", "10"]  # fmt: skip
    done = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, f"one line: {done.stderr}"
    return done.stderr
