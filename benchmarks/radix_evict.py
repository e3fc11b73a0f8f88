"""What one eviction costs in a full cache, against the number of nodes the tree holds.

With the device pool full, every page a running request needs is an eviction: a decode step evicts a
page or so, and each eviction call used to build a heap of every node in the tree. This times the steady
state of such a cache: per step, one cached prompt is matched (a new request's admission touches it),
one page is evicted (least recently used), and a new one-page prompt is cached in its place, so the tree
keeps its size. Reported per tree size: microseconds per eviction call, and per step. Run it with
either version of the tree on PYTHONPATH:

    PYTHONPATH=. python benchmarks/radix_evict.py [--nodes 1000,10000,100000] [--steps 2000]
"""

from __future__ import annotations

import argparse
import random
import time

from hicache.cache.radix import RadixTree

PAGE = 64


def prompt(i: int) -> list[int]:
    """A one-page prompt of its own under a shared two-page system prompt."""
    return [7] * (2 * PAGE) + [i] * PAGE


def steady_state_us(nodes: int, steps: int) -> tuple[float, float]:
    """Microseconds per eviction call and per step of a cache of `nodes` prompts (a step: match one,
    evict a page, cache a new prompt)."""
    tree = RadixTree(PAGE, on_device_free=lambda pages: None)
    next_page = iter(range(10**9))
    for i in range(nodes):
        tree.insert(prompt(i), [next(next_page) for _ in range(3)])
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
        tree.insert(prompt(nodes + step), [next(next_page) for _ in range(3)])
        live.append(nodes + step)
    return evicting / steps * 1e6, (clock() - start) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="1000,10000,100000")
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    print("| nodes in the tree | µs per eviction call (1 page) | µs per step (match + evict + insert) |")
    print("| ---: | ---: | ---: |")
    for n in map(int, args.nodes.split(",")):
        evict_us, step_us = steady_state_us(n, args.steps)
        print(f"| {n:,} | {evict_us:,.1f} | {step_us:,.1f} |")


if __name__ == "__main__":
    main()
