"""Stored pages are shared across topologies only where every topology computes the same bits: a rank
whose kernels round otherwise at one thread than at its own count (the self-check's one-thread probe)
namespaces its pages by the count, so a server of another TP size or thread count misses them."""

import torch

from hicache.cache.build import storage_identity
from hicache.model.kernels.invariance import InvarianceReport


def test_pages_are_kept_apart_by_thread_count_only_where_the_kernels_change_with_it() -> None:
    assert storage_identity("model", InvarianceReport(True)) == "model"
    assert storage_identity("model", None) == "model"  # plain ops (benchmarks): nothing was checked
    differs = InvarianceReport(True, thread_count_invariant=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        at_one = storage_identity("model", differs)
        torch.set_num_threads(2)
        at_two = storage_identity("model", differs)
    finally:
        torch.set_num_threads(threads)
    assert len({"model", at_one, at_two}) == 3
