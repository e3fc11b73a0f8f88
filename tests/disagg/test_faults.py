"""Faults of a prefill-decode deployment behind `hicache router`: a decode server restarted mid-
conversation falls back to a full transfer and stays correct; a prefill server killed mid-transfer
fails the request cleanly, the decode pool's leak check holds, and once prefill is back the next
request succeeds. (Prefill sends small, delayed messages here, so a transfer takes long enough to kill
it in the middle.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.disagg.deployment import DECODE_REUSE, complete, decode_counters, ports, prefill_args, router, serve, started
from tests.server.server_harness import assert_no_leaks, metric, scrape

pytestmark = pytest.mark.slow  # servers, ranks or long workloads: `make test-fast` leaves these out

SLOW = ("--disaggregation-transfer-chunk-pages", "4", "--debug-disagg-chunk-delay-ms", "100")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("pd-faults")
    p_port, d_port, ref_port, r_port, boot = ports(5)
    servers = {
        "prefill": serve(logs, p_port, *prefill_args(boot, *SLOW)),
        "decode": serve(logs, d_port, *DECODE_REUSE, "--disaggregation-transfer-timeout", "30"),
        "ref": serve(logs, ref_port, "--disable-radix-cache"),
    }
    with started(*servers.values()):
        front = router(logs, r_port, [servers["prefill"].url], [servers["decode"].url])
        try:
            with started(front):
                yield {"logs": logs, "router": front.url, "servers": servers, "ports": (p_port, d_port, boot)}
        finally:  # the servers `restart` started in place of the first ones
            for server in servers.values():
                server.stop()


def restart(deployment: dict, name: str, *args: str) -> None:
    """Stop (or find dead) a server and start it again on the same ports; the router keeps its URL."""
    old = deployment["servers"][name]
    old.stop()
    port = int(old.url.rsplit(":", 1)[1])
    new = serve(deployment["logs"], port, *args)
    new.wait_healthy()
    deployment["servers"][name] = new


def prefix_len(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    details = response.json()["usage"]["prompt_tokens_details"]
    assert details["decode_prefix_tokens"] + details["transferred_tokens"] == response.json()["usage"]["prompt_tokens"]
    return details["decode_prefix_tokens"]


def test_a_restarted_decode_falls_back_to_a_full_transfer_and_stays_correct(deployment):
    front, ref = deployment["router"], deployment["servers"]["ref"].url
    history = list(range(50, 130)) * 2
    assert prefix_len(complete(front, history)) == 0
    history += list(range(60, 110))
    assert prefix_len(complete(front, history)) >= 160, "decode reuses the first turn"
    restart(deployment, "decode", *DECODE_REUSE, "--disaggregation-transfer-timeout", "30")
    history += list(range(70, 120))
    got = complete(front, history)
    assert prefix_len(got) == 0, "a fresh decode server holds nothing: the whole prompt is transferred"
    assert got.json()["choices"][0]["text"] == complete(ref, history).json()["choices"][0]["text"]
    history += list(range(80, 130))
    got = complete(front, history)
    assert prefix_len(got) > 0, "and it reuses again from the next turn on"
    assert got.json()["choices"][0]["text"] == complete(ref, history).json()["choices"][0]["text"]


def test_a_prefill_killed_mid_transfer_fails_the_request_cleanly(deployment):
    front, ref = deployment["router"], deployment["servers"]["ref"].url
    decode = deployment["servers"]["decode"].url
    prompt = list(range(33, 233)) * 6  # 1200 tokens: 19 messages of 4 pages, 100 ms apart
    before = decode_counters(decode)
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(complete(front, prompt)))
    sender.start()
    deadline = time.monotonic() + 30
    while decode_counters(decode)["bytes"] == before["bytes"]:
        assert time.monotonic() < deadline, "no KV ever arrived"
        time.sleep(0.02)
    prefill = deployment["servers"]["prefill"]
    os.kill(prefill.proc.pid, signal.SIGKILL)  # mid-transfer: the first messages have landed
    sender.join(60)
    (answer,) = answers
    assert answer.status_code >= 500 and answer.json()["error"]["message"], answer.text
    assert_no_leaks(decode)  # flush, then no page, lock or promise left behind
    failed = metric(scrape(decode), "hicache_disagg_transfers_total", outcome="failed")
    assert failed >= 1
    boot = deployment["ports"][2]
    restart(deployment, "prefill", *prefill_args(boot, *SLOW))
    got = complete(front, prompt[:300])
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == complete(ref, prompt[:300]).json()["choices"][0]["text"]
    assert_no_leaks(decode)
