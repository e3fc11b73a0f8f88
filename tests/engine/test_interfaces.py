"""The interface a rank's gloo binds (hicache/engine/interfaces.py): the one that reaches the rendezvous
host, unless the user named one. The case it exists for, ranks on two hosts, is
tests/fleet/test_several_hosts.py."""

from __future__ import annotations

import os

import pytest

from hicache.engine.interfaces import GLOO_INTERFACE_VAR, choose_gloo_interface


def test_a_loopback_rendezvous_binds_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_INTERFACE_VAR, "unset below")  # recorded, so the test's choice is undone after it
    monkeypatch.delenv(GLOO_INTERFACE_VAR)
    choose_gloo_interface("tcp://127.0.0.1:29500")
    assert os.environ[GLOO_INTERFACE_VAR] == "lo"


def test_the_users_choice_and_torchruns_rendezvous_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_INTERFACE_VAR, "eth7")
    choose_gloo_interface("tcp://127.0.0.1:29500")
    assert os.environ[GLOO_INTERFACE_VAR] == "eth7"
    monkeypatch.delenv(GLOO_INTERFACE_VAR)
    choose_gloo_interface("env://")
    assert GLOO_INTERFACE_VAR not in os.environ
