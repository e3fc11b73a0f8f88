"""The model runner's batch building: one step's work items (a decode token, prefill chunks) become one
flat batch whose ids, positions, KV slots (those of the request's pages) and logit rows are exactly
those of each item; and every item that reaches its last known token gets a sample."""

from __future__ import annotations

import pytest
import torch

from hicache.config import EngineConfig
from hicache.engine.build import build_scheduler
from hicache.model.families.tiny import load_tiny
from hicache.parallel.parallel import ParallelContext
from hicache.scheduler.model_runner import WorkItem
from hicache.scheduler.request import Request, SamplingParams

PAGE = 16


@pytest.fixture(scope="module")
def scheduler():
    cfg = EngineConfig(model="tiny", max_total_tokens=64 * PAGE, page_size=PAGE, device="cpu")
    return build_scheduler(cfg, load_tiny(), ParallelContext())


def admitted(scheduler, prompt: list[int], computed: int = 0, outputs: tuple[int, ...] = ()) -> Request:
    """A request admitted through the cache API, with `computed` tokens' KV already there."""
    req = Request(prompt, SamplingParams(max_new_tokens=8), 8, output_ids=list(outputs))
    req.kv_handle = scheduler.cache.open(req.rid, prompt, "")
    assert scheduler.cache.admit(req.kv, -(-(len(prompt) + 8) // PAGE)).admitted
    scheduler.cache.extend(req.kv, computed)
    req.kv.advance(computed)
    return req


def test_a_mixed_batch_keeps_each_items_tokens_slots_and_logit_row(scheduler):
    decoding = admitted(scheduler, list(range(40, 60)), computed=21, outputs=(70, 71))  # 20 + 1 computed
    fresh = admitted(scheduler, list(range(80, 130)))
    chunked = admitted(scheduler, list(range(140, 180)), computed=16)
    work = [WorkItem(decoding, 21, 22), WorkItem(fresh, 0, 32), WorkItem(chunked, 16, 40)]
    for item in work:
        scheduler.cache.extend(item.req.kv, item.end)
    batch = scheduler.runner.build(work)
    allocator = scheduler.runner.pool.allocator
    assert batch.input_ids.tolist() == [71] + list(range(80, 112)) + list(range(156, 180))
    assert batch.positions.tolist() == [21] + list(range(32)) + list(range(16, 40))
    starts = [0, 1, 33]
    for item, seq, start in zip(work, batch.seqs, starts):
        slots = allocator.slots(item.req.kv.pages, item.end)
        assert (seq.start, seq.length, seq.kv_len) == (start, item.end - item.start, item.end)
        assert torch.equal(seq.kv_slots, slots), f"request {item.req.rid}: attention reads other slots"
        assert torch.equal(batch.out_slots[start : start + seq.length], slots[item.start :])
    # Only the decode token and the chunk that finishes its prompt need logits (the fresh prompt has more).
    assert [item.needs_logits for item in work] == [True, False, True]
    assert batch.logit_rows.tolist() == [0, 1 + 32 + 24 - 1]
    for req in (decoding, fresh, chunked):
        scheduler.cache.release(req.kv, req.tokens(req.kv.kv_len))


def test_forward_and_sample_give_one_token_per_logit_row(scheduler):
    a = admitted(scheduler, list(range(190, 207)))
    b = admitted(scheduler, list(range(210, 240)))
    work = [WorkItem(a, 0, 17), WorkItem(b, 0, 30)]
    for item in work:
        scheduler.cache.extend(item.req.kv, item.end)
    logits = scheduler.runner.forward(work)
    assert logits is not None and logits.shape == (2, scheduler.runner.model.cfg.vocab_size)
    samples = scheduler.runner.sample(logits, work)
    assert [token for token, _ in samples] == logits.argmax(dim=1).tolist(), "greedy samples the top logit"
    assert scheduler.runner.sample(None, [WorkItem(b, 0, 10)]) == [], "nothing to sample before the prompt's end"
    for req in (a, b):
        scheduler.cache.release(req.kv, req.tokens(req.kv.kv_len))
    assert scheduler.flush() and scheduler.leak_report() == []
