"""Helpers shared by the benchmark scripts: the machine's limits measured in the same run."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Self

import httpx
import torch

from hicache.engine.launch import free_port


def best_time(fn, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(dtype: torch.dtype, max_n: int = 2048, enough_s: float = 0.2) -> tuple[float, int]:
    """GFLOP/s of an n x n `F.linear` (the GEMM the model's projections run) and the n measured: n doubles
    from 256 until one product takes `enough_s` or n reaches `max_n`, so a dtype the CPU lacks a fast path
    for (bf16 on an AVX2-only CPU: under 1 GFLOP/s for `a @ b`) is measured in seconds, not minutes."""
    n = 256
    while True:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        seconds = best_time(lambda: torch.nn.functional.linear(a, b))
        if seconds >= enough_s or n >= max_n:
            return 2 * n**3 / seconds / 1e9, n
        n *= 2


def measure_in_tree(tree: str, script: str, args: list[str]):
    """Run `script --one ARGS` in a fresh interpreter importing `hicache` from `tree` (a checkout beside this
    one, for a before/after in the same run) and return the JSON its last line prints."""
    command = [sys.executable, script, "--one", *args]
    out = subprocess.run(command, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memcpy_gbps(nbytes: int = 1 << 28) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / best_time(lambda: dst.copy_(src)) / 1e9


def copy_gbps_read_write(nbytes: int = 1 << 29) -> float:
    """Memory bandwidth from a large tensor copy, counting the bytes read plus the bytes written (2n for
    a copy of n bytes): the traffic a stream of weight reads competes with. `nbytes` should dwarf the
    last-level cache."""
    return 2 * memcpy_gbps(nbytes)


def cpu_name() -> str:
    """The CPU's model name, the vector ISA /proc/cpuinfo reports and the one torch dispatches to."""
    name, flags = platform.processor() or "cpu", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = (
        "AVX512+BF16"
        if "avx512_bf16" in flags
        else "AVX512"
        if "avx512f" in flags
        else "AVX2"
        if "avx2" in flags
        else "?"
    )
    return f"{name} ({isa} in /proc/cpuinfo; torch dispatches {torch.backends.cpu.get_cpu_capability()})"


LLAMA_CPP_INSTALL = (
    "python3 -m venv /work/llama-venv && /work/llama-venv/bin/pip install 'llama-cpp-python[server]' "
    "(builds llama.cpp from source: ~3.3 min on 2 cores), then pass --llama-cpp-python /work/llama-venv/bin/python"
)


class LlamaCppCompletion:
    """One completion: its wall time through HTTP, usage counts, and llama.cpp's own timings of it
    (from the `llama_perf_context_print` lines its verbose server writes to stderr; None if absent)."""

    def __init__(self, seconds: float, body: dict, log: str) -> None:
        self.seconds = seconds
        self.prompt_tokens = int(body["usage"]["prompt_tokens"])
        self.completion_tokens = int(body["usage"]["completion_tokens"])
        self.text = body["choices"][0]["text"]
        num = r"\s*=\s*([\d.]+) ms /\s*(\d+)"
        prompt = re.findall(r"prompt eval time" + num, log)
        decode = re.findall(r"\beval time" + num + r" runs", log)
        hit = re.findall(r"(\d+) prefix-match hit", log)
        self.prompt_eval = (float(prompt[-1][0]) / 1000, int(prompt[-1][1])) if prompt else None  # (s, tokens)
        self.eval = (float(decode[-1][0]) / 1000, int(decode[-1][1])) if decode else None  # (s, runs)
        self.prefix_hit = int(hit[-1]) if hit else 0


class LlamaCppServer:
    """llama-cpp-python's OpenAI-compatible server as a subprocess of `python` (an interpreter that can
    import llama_cpp, kept out of the project's venv), on 127.0.0.1 at a free port; stopped by its pid
    when the `with` block ends, also on error. Its stdout and stderr go to a temporary log."""

    def __init__(self, python: str, model: str, threads: int, n_ctx: int = 4096, startup_s: float = 300) -> None:
        self.python, self.model, self.threads, self.n_ctx, self.startup_s = (
            python,
            str(model),
            threads,
            n_ctx,
            startup_s,
        )
        self.proc = None

    def __enter__(self) -> Self:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-cpp-server-", suffix=".log", delete=False)
        self.args = [
            self.python,
            "-m",
            "llama_cpp.server",
            "--model",
            self.model,
            "--n_threads",
            str(self.threads),
            "--n_threads_batch",
            str(self.threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_ctx",
            str(self.n_ctx),
        ]
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=600)
        deadline = time.monotonic() + self.startup_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama.cpp server exited with {self.proc.returncode}: {self._log_tail()}")
                try:
                    if self.client.get("/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama.cpp server not up after {self.startup_s:.0f} s: {self._log_tail()}")
                time.sleep(0.25)
            version = subprocess.run(
                [self.python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                check=False,
                capture_output=True,
                text=True,
                timeout=60,
            )
            self.version = version.stdout.strip() or "?"
        except BaseException:
            self.__exit__()
            raise
        return self

    def complete(self, prompt: str, max_tokens: int, eos: int | None = 2) -> LlamaCppCompletion:
        """Greedy completion of `prompt`; `eos` (SmolLM2's <|im_end|>) is banned so it runs max_tokens."""
        start_log = self._log_size()
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        if eos is not None:
            body["logit_bias"] = {str(eos): -100.0}
        start = time.perf_counter()
        response = self.client.post("/v1/completions", json=body)
        seconds = time.perf_counter() - start
        response.raise_for_status()
        time.sleep(0.05)  # its timings are printed before the response is sent; let the log catch up
        return LlamaCppCompletion(seconds, response.json(), self._log_since(start_log))

    def describe(self) -> str:
        return f"llama-cpp-python {self.version}, `{' '.join(self.args[1:])}`"

    def _log_size(self) -> int:
        self.log.flush()
        return os.path.getsize(self.log.name)

    def _log_since(self, offset: int) -> str:
        with open(self.log.name, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def _log_tail(self, n: int = 1500) -> str:
        return self._log_since(max(0, self._log_size() - n)).strip()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "client", None) is not None:
            self.client.close()
        self.log.close()
        os.unlink(self.log.name)
