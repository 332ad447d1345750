"""The supervise loop at scale: 32 lightweight protocol-conformant rollout servers on loopback
addresses, two of them hung. Every server is asked at once (what the servers saw in flight
shows it), within a bound on requests in flight, and a hung server is found lost while the
others answer. Poll times are measured in benchmarks/supervise_poll.py, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from uuid import uuid4

import httpx
import pytest
from orchestration.placed import PlacedProcess, PlacedRun
from orchestration.placement import Placement, ServerSlot, TrainerSlot
from orchestration.probe import probe
from orchestration.providers.base import Node, NodeInventory

from training_core.config import load_spec

HUNG = (5, 21)


@pytest.fixture
def servers():
    proc = subprocess.Popen([sys.executable, "-m", "tests.orchestration.tiny_servers", "--count",
                             "32", "--delay", "0.2", "--hang", ",".join(map(str, HUNG)),
                             "--version", "3"], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        yield info
    finally:
        proc.kill()
        proc.wait()


def _stats(info) -> dict:
    return httpx.get(info["control"] + "/stats", timeout=5).json()


def test_every_server_is_asked_at_once_and_the_hung_ones_are_reported(servers):
    result = probe(servers["urls"], timeout_s=2.0, concurrency=64)
    for i, answer in enumerate(result.infos):
        if i in HUNG:
            assert answer is None, i
        else:
            assert answer["weight_version"] == "3", (i, answer)
    # All 32 requests were in flight together: concurrent, not one server after another
    # (sequentially the servers would never see more than one).
    assert _stats(servers)["max_in_flight"] == 32


def test_requests_in_flight_stay_within_the_bound(servers):
    result = probe(servers["urls"], timeout_s=2.0, concurrency=8)
    assert sum(a is not None for a in result.infos) == 30
    stats = _stats(servers)
    assert stats["requests"] == 32 and 2 <= stats["max_in_flight"] <= 8


def test_supervise_finds_a_hung_server_lost_and_names_it(servers, monkeypatch):
    spec = load_spec(None, ["orchestration.server_lost_after_s=1", "orchestration.probe_timeout_s=0.5",
                            "rollout.num_servers=32"])
    inventory = NodeInventory([Node(f"127.0.0.{i}") for i in range(2, 10)])
    placement = Placement((TrainerSlot(0, 0, ()),),
                          tuple(ServerSlot(i, i % 8, (), 1) for i in range(32)))
    run = PlacedRun(1, "sealed", spec, inventory, placement, "pool")
    run.trainers = [PlacedProcess("trainer node 0 on node-0", 0, uuid4())]
    run.servers = [PlacedProcess(f"rollout server {i} on node-{i % 8}", i % 8, uuid4())
                   for i in range(32)]
    run.urls = list(servers["urls"])
    calls = []
    monkeypatch.setattr("orchestration.placed.queue_ages", lambda pool: {})  # workers: polling
    # The flow runs' states come from Prefect; here every process is running.
    monkeypatch.setattr(PlacedRun, "_states",
                        lambda self, ps: calls.append(len(ps)) or {p: ("RUNNING", "") for p in ps})

    class Tracker:
        def run_info(self):
            return {"last_step": None}

    outcome = run.supervise(Tracker(), poll_s=0.05)
    assert outcome.status == "failed"
    assert f"rollout server {HUNG[0]} on node-{HUNG[0] % 8}" in outcome.reason
    assert "has not answered for 1s" in outcome.reason
    assert calls and set(calls) == {33}  # one state read per poll for all 33 processes
