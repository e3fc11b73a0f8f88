"""Transfers: every wait on an asynchronous copy or storage call is bounded, so a hung call fails the
step that waits on it (TransferTimeout) instead of stalling every request behind it."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.cache.controller import AckQueue, SupervisedWorker, TransferOp, TransferTimeout


def _stuck(release: threading.Event, milestone: threading.Event | None = None):
    def run(_: TransferOp) -> None:
        if milestone is not None:
            milestone.set()
        release.wait()

    return run


def test_waiting_on_a_hung_transfer_ends_at_its_deadline():
    release = threading.Event()
    worker = SupervisedWorker("test", timeout_s=0.2)
    op = worker.submit(TransferOp("load", _stuck(release)))
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="load transfer did not finish within 0.2 s"):
        op.wait()
    assert 0.2 <= time.monotonic() - started < 2.0
    release.set()
    op.wait()  # once it finishes, waiting returns
    worker.stop()


def test_a_reached_milestone_or_a_failure_ends_the_wait_early():
    release, layer0 = threading.Event(), threading.Event()
    worker = SupervisedWorker("test", timeout_s=5.0)
    op = worker.submit(TransferOp("load", _stuck(release, layer0)))
    op.wait(layer0)  # layer 0 landed: no need to wait for the rest
    release.set()

    def fails(_: TransferOp) -> None:
        raise OSError("device lost")

    failed = worker.submit(TransferOp("load", fails))
    started = time.monotonic()
    failed.wait(threading.Event())  # a milestone it will never reach: the failure ends the wait
    assert failed.failed and time.monotonic() - started < 1.0
    worker.stop()


def test_an_ack_queue_does_not_wait_forever_for_an_op_another_rank_called_done():
    release = threading.Event()
    worker = SupervisedWorker("test", timeout_s=0.2)
    queue = AckQueue()
    queue.push(worker.submit(TransferOp("backup", _stuck(release))))
    with pytest.raises(TransferTimeout):
        queue.pop(1)
    release.set()
    worker.stop()
