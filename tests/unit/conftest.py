"""tests/unit: no process, no network, no browser, no database (make test-fast runs this tree).

The rule is enforced, not only named: inside this tree, starting a process or connecting an
internet socket fails the test that tries (a Unix socket pair, in-process, is allowed: the
rollout client's tests script their server over one)."""

from __future__ import annotations

import socket
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_processes_or_network(monkeypatch):
    def refuse_process(*args, **kwargs):
        raise AssertionError("a unit test started a process: move it out of tests/unit")

    real_connect = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"a unit test opened a network connection to {address}: move it "
                                 "out of tests/unit")
        return real_connect(sock, address)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_process)
    monkeypatch.setattr(socket.socket, "connect", connect)
