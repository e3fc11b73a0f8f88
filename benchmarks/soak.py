"""Soak: a real `hicache serve` with device + host + storage tiers under concurrent multi-turn clients and
injected faults, checked against a cache-off server.

    .venv/bin/python benchmarks/soak.py [--backend file|redis] [--clients 16] [--turns 6] [--model tiny]

Phase 1 runs every conversation on a `--disable-radix-cache` server: the reference answers, which also
make the conversations' histories. Phase 2 replays the same prompts on the server under test from
`--clients` threads while faults are injected: client disconnects (a read timeout), streams abandoned
part way, stored objects corrupted and truncated, a Redis restart (redis backend), a server restart
half way (a new process on the same store), transfer delays and failed host -> device loads (server
flags). At the end: every
completed answer must equal the reference's, every failed request must carry an error message, and
after /flush_cache no page and no lock may be held; the server's RSS and open file descriptors are
recorded at its start and at the end. Exit status 1 if any of that does not hold. tests/test_soak.py
runs a short version in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from hicache.bench.launcher import ServerProcess  # noqa: E402
from tests.storage.redis_server import RedisServer  # noqa: E402

SYSTEM = "You are the assistant of a travel desk. Keep every answer short and plain. " * 4
QUESTIONS = ("Where is Lisbon?", "What river runs there?", "Name a dish.", "And a drink?", "Which season?",
             "How do I get there?", "What should I pack?", "Is it expensive?")  # fmt: skip
ACTIONS = ("complete", "stream", "abandon_stream", "disconnect")


@dataclass
class SoakConfig:
    backend: str = "file"
    clients: int = 16
    turns: int = 6
    model: str = "tiny"
    max_tokens: int = 24
    device_tokens: int = 1024  # well below the conversations' working set: device eviction, host hits
    transfer_delay_ms: int = 5
    load_fail_rate: float = 0.1  # host -> device loads that fail (the requests needing them recompute)
    action_weights: tuple[float, ...] = (0.55, 0.25, 0.1, 0.1)
    corrupt_every_s: float = 0.5
    seed: int = 0


@dataclass
class SoakReport:
    requests: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)
    wrong_answers: list[str] = field(default_factory=list)
    errors_without_message: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)
    pool_used_after_flush: dict[str, float] = field(default_factory=dict)
    rss_mb: tuple[float, float] = (0.0, 0.0)  # after warm-up, at the end
    open_fds: tuple[int, int] = (0, 0)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    still_answers: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            not self.wrong_answers
            and self.errors_without_message == 0
            and not self.leaks
            and all(v == 0 for v in self.pool_used_after_flush.values())
            and self.still_answers
        )


def prompt_of(name: str, history: list[tuple[str, str]], question: str) -> str:
    turns = "".join(f"\nUser: {q}\nAssistant: {a}" for q, a in history)
    return f"{SYSTEM}The traveller is {name}.{turns}\nUser: {question}\nAssistant:"


def reference_conversations(url: str, cfg: SoakConfig) -> list[list[tuple[str, str]]]:
    """Every conversation's (prompt, answer) per turn, from the cache-off server."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    convs: list[list[tuple[str, str]]] = [[] for _ in range(cfg.clients)]
    histories: list[list[tuple[str, str]]] = [[] for _ in range(cfg.clients)]

    def turn(i: int, k: int) -> None:
        question = QUESTIONS[k % len(QUESTIONS)]
        prompt = prompt_of(f"traveller-{i}", histories[i], question)
        r = client.completions.create(model=cfg.model, prompt=prompt, max_tokens=cfg.max_tokens, temperature=0)
        convs[i].append((prompt, r.choices[0].text))
        histories[i].append((question, r.choices[0].text))

    for k in range(cfg.turns):
        threads = [threading.Thread(target=turn, args=(i, k)) for i in range(cfg.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return convs


class Client:
    """One conversation replayed with one chaos action per turn."""

    def __init__(self, url: str, cfg: SoakConfig, conv: list[tuple[str, str]], seed: int) -> None:
        self.url = url
        self.cfg = cfg
        self.conv = conv
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.silent_errors = 0
        self.tiers: Counter[str] = Counter()
        self.openai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def run(self) -> None:
        for k, (prompt, expected) in enumerate(self.conv):
            action = self.rng.choices(ACTIONS, self.cfg.action_weights)[0]
            body = {"model": self.cfg.model, "prompt": prompt, "max_tokens": self.cfg.max_tokens, "temperature": 0}
            try:
                got = getattr(self, action)(body)
            except httpx.TimeoutException:
                self.outcomes["client_disconnected"] += 1
                continue
            if got is None:
                continue
            if got != expected:
                self.wrong.append(f"turn {k}: {got!r} != {expected!r}")

    def complete(self, body: dict) -> str | None:
        try:
            r = self.openai.completions.create(**body)
        except Exception as exc:  # noqa: BLE001 - an API error: must carry a message
            self._failed(str(exc), getattr(exc, "status_code", "error"))
            return None
        self.outcomes["completed"] += 1
        details = (r.usage.prompt_tokens_details.model_extra or {}).get("cached_tokens_by_tier", {})
        self.tiers.update(details)
        return r.choices[0].text

    def stream(self, body: dict, abandon_after: int | None = None) -> str | None:
        text = []
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                self._failed(r.read().decode(), r.status_code)
                return None
            for n, line in enumerate(r.iter_lines()):
                if abandon_after is not None and n >= abandon_after:
                    self.outcomes["stream_abandoned"] += 1
                    return None  # closing the connection cancels the request
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self._failed(chunk["error"].get("message", ""), chunk["error"].get("code") or "stream")
                    return None
                if chunk.get("usage"):
                    self.tiers.update(chunk["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"])
                text.extend(c["text"] for c in chunk["choices"])
        self.outcomes["completed"] += 1
        return "".join(text)

    def abandon_stream(self, body: dict) -> None:
        self.stream(body, abandon_after=self.rng.randint(1, 4))

    def disconnect(self, body: dict) -> None:
        # Gone before the answer: a read timeout far shorter than the request closes the connection.
        httpx.post(f"{self.url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.02))
        self.outcomes["completed_before_disconnect"] += 1  # it was faster than the client gave up

    def _failed(self, message: str, status: object) -> None:
        self.outcomes[f"failed_{status}"] += 1
        if not message.strip():
            self.silent_errors += 1


class StorageFaults:
    """Corrupts or truncates one stored object at once and then every `corrupt_every_s` seconds; restarts
    Redis (an empty store: no persistence) once, early, if asked."""

    def __init__(
        self, cfg: SoakConfig, store_dir: Path | None, redis: RedisServer | None, restart_redis: bool = False
    ) -> None:
        self.cfg = cfg
        self.store_dir = store_dir
        self.redis = redis
        self.restart_redis = restart_redis and redis is not None
        self.counts: Counter[str] = Counter()
        self.rng = random.Random(cfg.seed + 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> StorageFaults:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            if self.store_dir is not None:
                self._damage_file()
            elif self.redis is not None:
                self._damage_redis()
                if self.restart_redis and self._stop.wait(0.3) is False:
                    self.redis.stop()
                    time.sleep(0.5)  # requests meanwhile find the store down: misses, never errors
                    self.redis.start()
                    self.counts["redis_restarted"] += 1
                    self.restart_redis = False
            if self._stop.wait(self.cfg.corrupt_every_s):
                return

    def _damage_file(self) -> None:
        assert self.store_dir is not None
        objects = [p for p in self.store_dir.rglob("*") if p.is_file() and not p.name.startswith(".")]
        if not objects:
            return
        # Among the newest: the pages the conversations' next turns are most likely to read back.
        objects.sort(key=lambda p: p.stat().st_mtime if p.exists() else 0)
        victim = self.rng.choice(objects[-20:])
        try:
            data = victim.read_bytes()
            if self.rng.random() < 0.5:
                victim.write_bytes(data[: len(data) // 2])
                self.counts["objects_truncated"] += 1
            else:
                i = self.rng.randrange(len(data))
                victim.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
                self.counts["objects_corrupted"] += 1
        except OSError:
            pass  # evicted or replaced meanwhile

    def _damage_redis(self) -> None:
        import redis as redis_py

        assert self.redis is not None
        try:
            conn = redis_py.Redis.from_url(self.redis.url, socket_timeout=1)
            keys = conn.keys("*")
            if keys:
                key = self.rng.choice(keys)
                value = conn.get(key) or b""
                conn.set(key, value[: len(value) // 2])
                self.counts["objects_truncated"] += 1
        except redis_py.RedisError:
            pass  # restarting


def process_usage(pid: int) -> tuple[float, int]:
    """(RSS in MB, open file descriptors) of a process."""
    rss_kb = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def server_flags(cfg: SoakConfig, storage: list[str]) -> list[str]:
    return [
        # Host memory twice the device pool, far below the working set: prefixes fall out of host
        # memory and come back from storage within the run, so damaged objects are read (and must be
        # caught); with less, 16 clients' prefetches after a restart mostly find the host tier full.
        "--model", cfg.model, "--enable-hierarchical-cache", "--max-total-tokens", str(cfg.device_tokens),
        "--hicache-ratio", "2.0", "--hicache-load-back-threshold", "16",
        "--hicache-storage-prefetch-threshold", "64", "--debug-transfer-delay-ms", str(cfg.transfer_delay_ms),
        "--debug-load-fail-rate", str(cfg.load_fail_rate), *storage,
    ]  # fmt: skip


def run_soak(cfg: SoakConfig, workdir: Path) -> SoakReport:
    """Phase 2 runs in two halves of the turns on two server processes over the same store: the
    restart is a fault of its own, and it makes the second half's prefixes come back from storage."""
    started = time.monotonic()
    report = SoakReport(requests=cfg.clients * cfg.turns)
    with ServerProcess(["--model", cfg.model, "--disable-radix-cache"]) as ref:
        convs = reference_conversations(ref.url, cfg)
    redis = RedisServer(workdir / "redis", persist=True) if cfg.backend == "redis" else None
    store_dir = workdir / "store" if cfg.backend == "file" else None
    if redis is not None:
        (workdir / "redis").mkdir(exist_ok=True)
        redis.start()
        storage = ["--hicache-storage-backend", "redis", "--hicache-storage-url", redis.url]
    else:
        storage = ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(store_dir)]
    outcomes: Counter[str] = Counter()
    tiers: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    try:
        for half, turns in enumerate((range(cfg.turns // 2), range(cfg.turns // 2, cfg.turns))):
            with ServerProcess(server_flags(cfg, storage)) as server:
                assert server.pid is not None
                rss, fds = process_usage(server.pid)
                clients = [
                    Client(server.url, cfg, [conv[k] for k in turns], cfg.seed * 1000 + 100 * half + i)
                    for i, conv in enumerate(convs)
                ]
                with StorageFaults(cfg, store_dir, redis, restart_redis=half == 0) as damage:
                    threads = [threading.Thread(target=c.run) for c in clients]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                faults.update(damage.counts)
                _settle_and_check(server.url, report)
                end_rss, end_fds = process_usage(server.pid)
                report.rss_mb, report.open_fds = (rss, end_rss), (fds, end_fds)  # the last server's
                faults.update(_server_faults(server.url))
            for c in clients:
                outcomes.update(c.outcomes)
                tiers.update(c.tiers)
                report.wrong_answers += [f"half {half}, {w}" for w in c.wrong]
                report.errors_without_message += c.silent_errors
        faults["server_restarted"] += 1
    finally:
        if redis is not None:
            redis.stop()
    report.by_outcome, report.cached_tokens_by_tier, report.faults = dict(outcomes), dict(tiers), dict(faults)
    report.seconds = time.monotonic() - started
    return report


def _settle_and_check(url: str, report: SoakReport) -> None:
    """Flush (retrying while cancelled requests leave the batch), then no leak; and the server answers."""
    deadline = time.monotonic() + 30
    while httpx.post(f"{url}/flush_cache", timeout=30).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    report.leaks += httpx.get(f"{url}/debug/leaks", timeout=30).json()
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("hicache_pool_used_tokens{"):
            tier = line.split('tier="')[1].split('"')[0]
            used = float(line.rsplit(" ", 1)[1])
            report.pool_used_after_flush[tier] = max(report.pool_used_after_flush.get(tier, 0.0), used)
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2}, timeout=60)
    report.still_answers = r.status_code == 200  # the last server's answer decides


def _server_faults(url: str) -> dict[str, int]:
    """What the server counted of the faults: corrupt objects read, failed loads recomputed, and so on."""
    wanted = ("storage_corrupt", "storage_errors", "storage_put_failed_pages", "storage_put_retried_pages",
              "load_failed_pages", "load_timed_out_pages", "load_failed_requests", "transfer_failures")  # fmt: skip
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        value = int(float(line.rsplit(" ", 1)[-1])) if line and not line.startswith("#") else 0
        if line.startswith("hicache_cache_events_total{"):
            event = line.split('event="')[1].split('"')[0]
            if event in wanted:
                counts[f"server_{event}"] = value
        elif line.startswith(("hicache_prefetch_lost_pages_total{", "hicache_prefetch_pages_total{")) and value:
            label = line.split('="')[1].split('"')[0]
            counts[f"server_prefetch_{'lost_' if 'lost' in line else ''}{label}_pages"] = value
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["file", "redis"], default="file")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device-tokens", type=int, default=SoakConfig.device_tokens,
                        help="device KV pool (--max-total-tokens); must hold the longest conversation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = SoakConfig(
        backend=args.backend, clients=args.clients, turns=args.turns, model=args.model, seed=args.seed,
        device_tokens=args.device_tokens,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp:
        report = run_soak(cfg, Path(tmp))
    print(json.dumps({**asdict(report), "ok": report.ok}, indent=1))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
