"""What KV events cost the scheduler thread: the tree with its recorder off against on, in one run.

Two cases, each timed with the recorder off (the default: a call returns at once) and on (each step's
events drained and encoded as the publisher's thread would send them, docs/DESIGN.md "KV events"):

- steady state of a full cache: per step one cached prompt is matched, one page evicted and a new
  prompt cached (radix_evict.py's loop), so a step stores and drops a page or so;
- one long prompt cached at once (a 100K-token agent history), against the floor it cannot beat:
  SHA-256 over the same bytes (hashlib, measured here), since its pages' hashes are computed once.

    PYTHONPATH=. python benchmarks/kv_events_bench.py [--nodes 10000] [--steps 2000] [--tokens 100000]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

from benchmarks.common import best_time
from hicache.cache.radix import RadixTree
from hicache.events.wire import KVEventBatch, encode_payload, wire_events

PAGE = 64


def prompt(i: int) -> list[int]:
    """A one-page prompt of its own under a shared two-page system prompt."""
    return [7] * (2 * PAGE) + [i % 50000] * PAGE


def publish(tree: RadixTree, seq: int) -> int:
    """What a step adds with events on: drain, and encode the batch in vLLM's format (the publisher
    thread's share, without the index it keeps for replays)."""
    events = tree.events.drain()
    wire = [out for event in events for out in wire_events(event, PAGE, {})]
    return len(encode_payload(KVEventBatch(0.0, wire, 0))) if events else 0


def steady_state_us(nodes: int, steps: int, events: bool) -> float:
    """Microseconds per step (match one prompt, evict a page, cache a new prompt) of a full cache."""
    tree = RadixTree(PAGE, on_device_free=lambda pages: None)
    tree.events.enabled = events
    next_page = iter(range(10**9))
    for i in range(nodes):
        tree.insert(prompt(i), [next(next_page) for _ in range(3)])
    tree.events.drain()
    rng = random.Random(0)
    live = list(range(nodes))
    start = time.perf_counter()
    for step in range(steps):
        tree.match_prefix(prompt(rng.choice(live)))
        tree.evict(1)
        tree.insert(prompt(nodes + step), [next(next_page) for _ in range(3)])
        live.append(nodes + step)
        if events:
            publish(tree, step)
    return (time.perf_counter() - start) / steps * 1e6


def long_prompt_ms(tokens: int, events: bool) -> float:
    ids = [random.Random(1).randrange(32000) for _ in range(tokens - tokens % PAGE)]

    def once() -> None:
        tree = RadixTree(PAGE, on_device_free=lambda pages: None)
        tree.events.enabled = events
        tree.insert(ids, list(range(len(ids) // PAGE)))
        publish(tree, 1)

    return best_time(once, repeat=3) * 1e3


def sha256_floor_ms(tokens: int) -> float:
    pages = [bytes(4 * PAGE)] * (tokens // PAGE)

    def chain() -> None:
        prev = bytes(32)
        for page in pages:
            prev = hashlib.sha256(prev + page).digest()

    return best_time(chain, repeat=3) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=10000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=100000)
    args = p.parse_args()
    off, on = (steady_state_us(args.nodes, args.steps, e) for e in (False, True))
    print("| case | events off | events on | on / off |\n| --- | ---: | ---: | ---: |")
    print(f"| steady state, {args.nodes:,} nodes: µs a step | {off:,.1f} | {on:,.1f} | {on / off:.2f}x |")
    off, on = (long_prompt_ms(args.tokens, e) for e in (False, True))
    print(f"| one {args.tokens:,}-token prompt cached: ms | {off:,.1f} | {on:,.1f} | {on / off:.2f}x |")
    floor = sha256_floor_ms(args.tokens)
    print(f"\nSHA-256 chain over the same {args.tokens // PAGE:,} pages alone: {floor:,.1f} ms "
          f"(events' extra {on - off:,.1f} ms is {(on - off) / floor:.2f}x it)")


if __name__ == "__main__":
    main()
