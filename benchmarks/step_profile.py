"""Where one decode step's time goes: the model's forward at `--batch` sequences (default 1), each `--rows` new
rows (default 1: a decode step; 64: a short turn's prefill) after `context` keys, built as the engine builds it
(weight format, attention family, invariant plans, the engine's threads), timed bare and then under
torch.profiler (not a test).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/step_profile.py --model smollm2 --quantization auto --context 128
    PYTHONPATH=$PWD .venv/bin/python benchmarks/step_profile.py --model tiny --context 65536
    PYTHONPATH=$PWD .venv/bin/python benchmarks/step_profile.py --model smollm2 --context 2048 --rows 64

The pool's history holds random KV (a step's time does not depend on the values, and a 64K prefill
takes minutes). Wall: the median and best of `--steps` forwards on this thread; on a shared machine the
process's CPU time a step (every thread's) is steadier than either. The profile splits the
profiled step into the GEMMs (hicache's native ones and aten's), the attention kernel, every other op,
and what no op covers (Python between ops, allocation outside ops); the GEMMs and the attention are set
against their byte limit: the bytes they must read / a copy's bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.common import copy_gbps_read_write
from hicache.parallel.threads import cpu_threads, use_threads
from hicache.mem.device_pool import DeviceKVPool
from hicache.model.batch import ForwardBatch, SeqSlice
from hicache.model.build import build_decoder, resolve_quantization, with_attention_family, with_weight_format
from hicache.model.kernels.tp_groups import ColumnGroups, RowGroups
from hicache.model.loading.loader import load_model
from hicache.parallel.parallel import ParallelContext

PAGE = 16
GEMM_OPS = ("int4_linear", "int8_linear", "aten::linear", "aten::mm", "aten::addmm", "aten::matmul",
            "aten::_weight_int4pack_mm", "aten::_weight_int8pack_mm", "mkldnn")  # fmt: skip
ATTENTION_OPS = ("block_attend", "_scaled_dot_product_flash_attention")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build(model: str, quantization: str, context: int, batch: int = 1, rows: int = 1,
          kv_dtype: torch.dtype = torch.float32):  # fmt: skip
    device, dtype = torch.device("cpu"), torch.float32
    loaded = load_model(model)
    resolved = resolve_quantization(quantization, loaded, dtype, device)
    loaded = with_attention_family(with_weight_format(loaded, resolved, device), device)
    decoder = build_decoder(loaded, ParallelContext(), dtype, device)
    per_sequence = (-(-(context + rows) // PAGE) + 1) * PAGE  # each sequence's own pages
    pages = batch * per_sequence // PAGE
    pool = DeviceKVPool(decoder.kv_layout, decoder.num_local_layers, pages, PAGE, kv_dtype, device)
    gen = torch.Generator().manual_seed(0)
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    firsts = [i * per_sequence for i in range(batch)]
    step = ForwardBatch(
        input_ids=torch.full((batch * rows,), 7),
        positions=torch.arange(context, context + rows).repeat(batch),
        out_slots=torch.cat([torch.arange(first + context, first + context + rows) for first in firsts]),
        seqs=[SeqSlice(i * rows, rows, torch.arange(first, first + context + rows)) for i, first in enumerate(firsts)],
        logit_rows=torch.arange(rows - 1, batch * rows, rows),
    )
    return decoder, pool, step, resolved


def weight_bytes(decoder) -> int:
    """Bytes the step's linears read (codes, scales, offsets or dense weights), each once."""
    linears = [decoder.lm_head]
    for layer in decoder.layers:
        for projection in vars(layer).values():
            if isinstance(projection, (ColumnGroups, RowGroups)):
                linears += [projection.fused] if getattr(projection, "fused", None) else projection.groups
    return sum(linear.weight_bytes for linear in linears)


def profile(decoder, pool, step, steps: int) -> dict[str, tuple[float, int]]:
    """Per part, (ms a step, calls a step): self CPU time of every op, grouped."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            decoder.forward(step, pool)
    parts: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    others: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        name = event.key
        part = ("gemm" if any(g in name for g in GEMM_OPS) else
                "attention kernel" if any(a in name for a in ATTENTION_OPS) else "other ops")  # fmt: skip
        parts[part][0] += event.self_cpu_time_total / 1e3 / steps
        parts[part][1] += event.count / steps
        if part == "other ops":
            others[name][0] += event.self_cpu_time_total / 1e3 / steps
            others[name][1] += event.count / steps
    top = sorted(others.items(), key=lambda kv: -kv[1][0])[:12]
    print("  top other ops (ms a step, calls): " + ", ".join(f"{n} {t:.2f}/{c:.0f}" for n, (t, c) in top))
    return {k: (v[0], int(v[1])) for k, v in parts.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1, help="sequences a step decodes, each after `context` keys")
    parser.add_argument("--rows", type=int, default=1,
                        help="new rows a sequence's step computes (64 with --context 2048: a short turn's prefill)")
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0: the engine's choice)")
    parser.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16"], help="the pool's")
    args = parser.parse_args(argv)
    use_threads(args.threads or cpu_threads())
    kv_dtype = getattr(torch, args.kv_cache_dtype)
    decoder, pool, step, resolved = build(args.model, args.quantization, args.context, args.batch, args.rows, kv_dtype)
    gbps = copy_gbps_read_write(1 << 28)  # the byte limit's denominator: a 256 MiB copy, best of 5
    with torch.inference_mode():
        for _ in range(3):
            decoder.forward(step, pool)
        cpu_start = time.process_time()
        times = [_timed(lambda: decoder.forward(step, pool)) * 1e3 for _ in range(args.steps)]
        cpu = (time.process_time() - cpu_start) * 1e3 / args.steps
    wall = statistics.median(times)
    weights = weight_bytes(decoder)
    kv = args.batch * (args.context + args.rows) * pool.buffers[0][0].nbytes * decoder.num_local_layers  # a row's bytes
    print(f"{args.model} {resolved} float32 ({args.kv_cache_dtype} KV), {torch.get_num_threads()} threads, "
          f"batch {args.batch} x {args.rows} rows, context "
          f"{args.context}: step median "
          f"{wall:.2f} ms, best {min(times):.2f} ms, process CPU {cpu:.2f} ms a step; "
          f"copy {gbps:.1f} GB/s (read + write)")
    # A step only reads them: the limit is the bytes over the copy's read + write rate.
    # Issue 22's KV-read limit divides by the memcpy rate in bytes copied a second (half the read + write
    # rate): sections 22, 34 and 36 of docs/BENCHMARKS.md; both are printed.
    copied = kv / (gbps / 2) / 1e6
    print(f"  weights {weights / 1e6:.1f} MB -> read limit {weights / gbps / 1e6:.2f} ms; "
          f"KV {kv / 2**20:.1f} MiB -> {kv / gbps / 1e6:.2f} ms at the read + write rate, {copied:.2f} ms at "
          f"the memcpy rate (issue 22's KV-read limit: step / limit {wall / copied:.2f}x)")
    parts = profile(decoder, pool, step, max(3, args.steps // 4))
    for name, (ms, calls) in sorted(parts.items()):
        print(f"  {name:18s} {ms:7.2f} ms profiled, {calls:5d} calls a step")
    covered = sum(t for t, _ in parts.values())
    print(f"  ops {covered:.2f} ms profiled against {wall:.2f} ms bare: the rest (Python between ops) "
          f"{wall - covered:.2f} ms")

if __name__ == "__main__":
    main()
