"""What admission costs per step for a waiting 1M-token request that does not fit yet.

The scheduler tries the first waiting request again every step; admission matches its prompt (less the
last token) in the tree, with a hit counted. This times that match for a prompt held as a Python list,
as requests hold it, (a) sliced and packed every time (what admission did before the prompt was packed
once per handle, and all a tree without `PackedTokens` can do) and (b) from the handle's packed
prompt; the in-batch prefix check against one running request sharing 90 % of the prompt; and the key
a finished request's release caches (its prompt and 1,000 output tokens): the whole list converted, as
release did before `PackedTokens.prefix_of`, against the packed prompt with only the output converted.
Run it with either version of the tree on PYTHONPATH:

    PYTHONPATH=. python benchmarks/radix_waiting.py [--tokens 1000000]
"""

from __future__ import annotations

import argparse
import random
import time

from hicache.cache.radix import RadixTree


def best_ms(fn, repeat: int = 7) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--page-size", type=int, default=64)
    args = p.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(151_000) for _ in range(args.tokens)]
    other = prompt[: args.tokens * 9 // 10] + [rng.randrange(151_000) for _ in range(args.tokens // 10)]
    tree = RadixTree(args.page_size, on_device_free=lambda pages: None)
    n = len(prompt) // args.page_size * args.page_size
    tree.insert(prompt[:n], list(range(n // args.page_size)))
    print(
        f"| admission match, prompt list sliced and packed each step | "
        f"{best_ms(lambda: tree.match_prefix(prompt[: len(prompt) - 1], count_hit=True)):.2f} ms |"
    )
    try:
        from hicache.cache.page_keys import PackedTokens, pack
    except ImportError:  # the tree before packed keys
        from hicache.scheduler.scheduler import common_prefix_len

        print(
            f"| in-batch prefix check, 64-token list slices | "
            f"{best_ms(lambda: common_prefix_len(prompt, other)):.2f} ms |"
        )
        return
    packed, packed_other = PackedTokens(prompt), PackedTokens(other)
    view = packed.view(len(prompt) - 1)
    print(
        f"| admission match, from the handle's packed prompt | "
        f"{best_ms(lambda: tree.match_prefix(view, count_hit=True)):.3f} ms |"
    )
    print(f"| packing the prompt (once per request) | {best_ms(lambda: PackedTokens(prompt), repeat=3):.2f} ms |")
    print(f"| in-batch prefix check, packed prompts | {best_ms(lambda: packed.common_prefix(packed_other)):.3f} ms |")
    sequence = prompt + [rng.randrange(151_000) for _ in range(1000)]
    n = len(sequence) // args.page_size * args.page_size
    print(f"| release key, the whole sequence converted | {best_ms(lambda: pack(sequence[:n]), repeat=3):.2f} ms |")
    if hasattr(packed, "prefix_of"):
        print(
            f"| release key, packed prompt + output converted | "
            f"{best_ms(lambda: packed.prefix_of(sequence, n)):.2f} ms |"
        )


if __name__ == "__main__":
    main()
