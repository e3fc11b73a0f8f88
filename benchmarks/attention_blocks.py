"""A decode step's attention over long contexts: time and peak extra memory of the local backend's
four layers at tiny's shapes (4 heads, 2 KV heads, head_dim 32), against another code tree (not a test).

    git archive 0c6e9ef | tar -x -C /tmp/attn-before    # the last commit before blocked attention
    .venv/bin/python benchmarks/attention_blocks.py --baseline-tree /tmp/attn-before \\
        [--contexts 1024 16384 65536] [--batches 1 4] [--threads 1]

Each tree is measured in a process of its own (the tree's hicache first on sys.path). A step is what
the model runs per decode step for attention: the backend's `prepare`, then per layer the write of the
new KV rows and the attention of one query row per sequence, each sequence holding `context` keys in
the pool. Time: the median of 7 steps after 2 warm-ups. Peak: the most bytes torch held at once during
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


def measure(context: int, batch: int, threads: int) -> dict:
    """This process's hicache (the tree on sys.path) at one shape."""
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
    seqs = [SeqSlice(s, 1, torch.arange(s * pages * PAGE, s * pages * PAGE + context)) for s in range(batch)]
    step = ForwardBatch(
        input_ids=torch.zeros(batch, dtype=torch.int64),
        positions=torch.full((batch,), context - 1),
        out_slots=torch.stack([s.kv_slots[-1] for s in seqs]),
        seqs=seqs,
        logit_rows=torch.arange(batch),
    )
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    kv = torch.randn(batch, layout.row_numel, generator=gen)
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

    times = []
    for i in range(9):
        started = time.perf_counter()
        run()
        if i >= 2:
            times.append(time.perf_counter() - started)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    peak = held = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    kv_bytes = batch * context * LAYERS * layout.row_numel * dtype.itemsize
    return {"ms": 1e3 * statistics.median(times), "peak_mb": peak / 2**20, "kv_mb": kv_bytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", help="another checkout to measure beside this one")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)  # child: context batch
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.threads)))
        return
    # Imported here, in the parent only: a child imports `benchmarks` from the tree it measures, whose
    # common.py may predate this helper.
    from benchmarks.common import measure_in_tree

    trees = {"blocked": HERE, **({"before": args.baseline_tree} if args.baseline_tree else {})}
    print(f"{'tree':8} {'keys':>6} {'batch':>5} {'step ms':>8} {'peak MB':>8} {'KV MB':>8}")
    for context in args.contexts:
        for batch in args.batches:
            for name, tree in trees.items():
                r = measure_in_tree(tree, __file__, [str(context), str(batch), "--threads", str(args.threads)])
                print(f"{name:8} {context:>6} {batch:>5} {r['ms']:>8.2f} {r['peak_mb']:>8.2f} {r['kv_mb']:>8.1f}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
