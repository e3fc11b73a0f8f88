"""A decode step's attention over long contexts: time and peak extra memory of the local backend's
four layers at tiny's shapes (4 heads, 2 KV heads, head_dim 32), against another code tree (not a test).

    git archive 0c6e9ef | tar -x -C /tmp/attn-before    # the last commit before blocked attention
    .venv/bin/python benchmarks/attention_blocks.py --baseline-tree /tmp/attn-before \\
        [--contexts 1024 16384 65536] [--batches 1 4] [--threads 1] [--prefill]

Each tree is measured in a process of its own (the tree's hicache first on sys.path). A step is what
the model runs per decode step for attention: the backend's `prepare`, then per layer the write of the
new KV rows and the attention of one query row per sequence, each sequence holding `context` keys in
the pool. Time: the median of 7 steps after 2 warm-ups, and the best of them (on a shared machine the
least disturbed); beside each step a copy of as many bytes as it attends over, whose best is the KV-read
limit (best/copy: the step against it, both measured under the same load). Peak: the most bytes torch held at once during
one step beyond what it held before (every allocation and free the profiler records), the pool itself
excluded: what a step needs on top of the KV it reads. One kernel thread by default: on a shared
machine a parallel region waits for its slowest thread, and that wait, not the kernels, filled the
figures measured at two threads beside other work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 4, 2, 32, 16


def measure(context: int, batch: int, threads: int, prefill: bool = False) -> dict:
    """This process's hicache (the tree on sys.path) at one shape: a decode step, or (`prefill`) the
    attention of a cold prefill of `context` tokens of each sequence, every row over the keys before it."""
    import torch

    torch.set_num_threads(threads)

    from hicache.mem.device_pool import DeviceKVPool
    from hicache.mem.kv_layout import KVLayout
    from hicache.model.attention.backends import LocalAttention
    from hicache.model.batch import ForwardBatch, SeqSlice

    cpu, dtype = torch.device("cpu"), torch.get_default_dtype()
    layout = KVLayout.mha(KV_HEADS, HEAD_DIM)
    pages = -(-context // PAGE)
    pool = DeviceKVPool(layout, LAYERS, batch * pages + 1, PAGE, dtype, cpu)
    gen = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        pool.buffers[layer].copy_(torch.randn(pool.buffers[layer].shape, generator=gen))
    rows = context if prefill else 1
    seqs = [SeqSlice(s * rows, rows, torch.arange(s * pages * PAGE, s * pages * PAGE + context)) for s in range(batch)]
    step = ForwardBatch(
        input_ids=torch.zeros(batch * rows, dtype=torch.int64),
        positions=torch.arange(context - rows, context).repeat(batch),
        out_slots=torch.cat([s.kv_slots[-rows:] for s in seqs]),
        seqs=seqs,
        logit_rows=torch.arange(batch),
    )
    q = torch.randn(batch * rows, HEADS, HEAD_DIM, generator=gen)
    kv = torch.randn(batch * rows, layout.row_numel, generator=gen)
    backend = LocalAttention(HEAD_DIM**-0.5, cpu)

    def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = layout.unpack(rows)
        return parts["k"], parts["v"]

    try:  # the model's own expand, where the tree has it: the backend may then read the pool in place
        from hicache.model.attention.backends import UnpackKV

        expand = UnpackKV(layout)
    except ImportError:
        pass

    def run() -> None:
        meta = backend.prepare(step, pool)
        for layer in range(LAYERS):
            backend.forward(layer, q, kv, meta, pool, expand)

    kv_bytes = batch * context * LAYERS * layout.row_numel * dtype.itemsize
    # The KV-read limit measured beside each step: a copy of as many bytes as the step attends over.
    src = torch.ones(kv_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times, copies = [], []
    warm = 1 if prefill else 2
    for i in range(warm + (3 if prefill else 7)):
        started = time.perf_counter()
        run()
        if i >= warm:
            times.append(time.perf_counter() - started)
        started = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - started)
    del src, dst
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    peak = held = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return {"ms": 1e3 * statistics.median(times), "best_ms": 1e3 * min(times), "peak_mb": peak / 2**20,
            "kv_mb": kv_bytes / 2**20, "copy_ms": 1e3 * min(copies)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", help="another checkout to measure beside this one")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill", action="store_true", help="a cold prefill's attention instead of a decode step")
    parser.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)  # child: context batch
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.threads, args.prefill)))
        return
    # Imported here, in the parent only: a child imports `benchmarks` from the tree it measures, whose
    # common.py may predate this helper.
    from benchmarks.common import measure_in_tree

    trees = {"blocked": HERE, **({"before": args.baseline_tree} if args.baseline_tree else {})}
    print(f"{'tree':8} {'keys':>6} {'batch':>5} {'step ms':>8} {'best ms':>8} {'peak MB':>8} {'KV MB':>8}"
          f" {'copy ms':>8} {'best/copy':>9}")  # fmt: skip
    for context in args.contexts:
        for batch in args.batches:
            for name, tree in trees.items():
                flags = ["--threads", str(args.threads), *(["--prefill"] if args.prefill else [])]
                r = measure_in_tree(tree, __file__, [str(context), str(batch), *flags])
                print(f"{name:8} {context:>6} {batch:>5} {r['ms']:>8.2f} {r['best_ms']:>8.2f} {r['peak_mb']:>8.2f}"
                      f" {r['kv_mb']:>8.1f} {r['copy_ms']:>8.2f} {r['best_ms'] / r['copy_ms']:>9.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
