"""What one eviction costs in a full cache, against the number of nodes the tree holds.

With the device pool full, every page a running request needs is an eviction: a decode step evicts a
page or so, and each eviction call used to build a heap of every node in the tree. This times the steady
state of such a cache: per step, one cached prompt is matched (a new request's admission touches it),
one page is evicted (least recently used), and a new one-page prompt is cached in its place, so the tree
keeps its size. Reported per tree size: microseconds per eviction call, and per step. Run it with
either version of the tree on PYTHONPATH, or give the other one as --baseline-tree to measure both in
one run (each in its own interpreter) with this tree's figures as ratios to it:

    PYTHONPATH=. python benchmarks/radix_evict.py [--nodes 1000,10000,100000] [--steps 2000]
        [--baseline-tree DIR]

This tree is also measured with retention hints (docs/DESIGN.md, "retention hints"): every fourth
cached prompt carries priority 1 for 0.5 s of the arrival clock, which moves 1 ms a step, so hints are
set, lapse and reorder eviction all through the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from hicache.cache.radix import RadixTree

PAGE = 64


def prompt(i: int) -> list[int]:
    """A one-page prompt of its own under a shared two-page system prompt."""
    return [7] * (2 * PAGE) + [i] * PAGE


def steady_state_us(nodes: int, steps: int, hinted: bool = False) -> tuple[float, float]:
    """Microseconds per eviction call and per step of a cache of `nodes` prompts (a step: match one,
    evict a page, cache a new prompt); `hinted`: with retention hints (the module docstring)."""
    tree = RadixTree(PAGE, on_device_free=lambda pages: None)
    next_page = iter(range(10**9))

    def insert(i: int) -> None:
        pages = [next(next_page) for _ in range(3)]
        if not hinted:
            tree.insert(prompt(i), pages)
            return
        from hicache.cache.retention import Retention  # absent from a baseline tree before hints

        tree.insert(prompt(i), pages, retention=Retention(int(i % 4 == 0), 0.5, since=i / 1000))

    for i in range(nodes):
        insert(i)
    # The fill's hints that ran out lapse here, all at once, outside the timed steps: a one-off of the
    # fill (in a server they lapse a few per eviction, as in the steps below).
    tree.evict(0)
    rng = random.Random(0)
    live = list(range(nodes))
    clock = time.perf_counter
    evicting = 0.0
    start = clock()
    for step in range(steps):
        tree.match_prefix(prompt(rng.choice(live)))
        t = clock()
        tree.evict(1)
        evicting += clock() - t
        insert(nodes + step)
        live.append(nodes + step)
    return evicting / steps * 1e6, (clock() - start) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="1000,10000,100000")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--baseline-tree", help="another checkout to measure beside this one (plain LRU only)")
    p.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)  # child: nodes, hinted
    args = p.parse_args()
    if args.one:
        print(json.dumps(steady_state_us(args.one[0], args.steps, bool(args.one[1]))))
        return
    if not args.baseline_tree:
        print("| nodes in the tree | µs per eviction call (1 page) | µs per step (match + evict + insert) |")
        print("| ---: | ---: | ---: |")
        for n in map(int, args.nodes.split(",")):
            evict_us, step_us = steady_state_us(n, args.steps)
            print(f"| {n:,} | {evict_us:,.1f} | {step_us:,.1f} |")
        return
    # In the parent only: a child imports `benchmarks` from the tree it measures.
    from benchmarks.common import measure_in_tree

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {"before": (args.baseline_tree, 0), "this": (here, 0), "this, hinted": (here, 1)}
    print("| nodes in the tree | tree | µs per eviction call | ratio | µs per step | ratio |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n in map(int, args.nodes.split(",")):
        base: tuple[float, float] | None = None
        for name, (tree, hinted) in runs.items():
            evict_us, step_us = measure_in_tree(tree, __file__, [str(n), str(hinted), "--steps", str(args.steps)])
            base = base or (evict_us, step_us)
            print(f"| {n:,} | {name} | {evict_us:,.1f} | {evict_us / base[0]:.2f} | {step_us:,.1f} | "
                  f"{step_us / base[1]:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
