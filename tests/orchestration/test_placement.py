"""Which node runs what: the placement plan from the run spec and the provider's nodes."""

from __future__ import annotations

import pytest
from orchestration.placed import plan
from orchestration.providers.base import Node, NodeInventory, node_queue
from orchestration.providers.static import StaticNodeProvider

from training_core.config import load_spec


def _nodes(n: int) -> NodeInventory:
    return NodeInventory([Node(address=f"127.0.0.{i + 2}") for i in range(n)])


def test_default_trainer_on_the_first_node_servers_on_the_rest():
    spec = load_spec(None, ["rollout.num_servers=4"])
    p = plan(spec, _nodes(3))
    assert p.trainer_nodes == [0]
    assert p.server_nodes == [1, 2, 1, 2]


def test_explicit_nodes_and_a_trainer_that_uses_every_node():
    spec = load_spec(None, ["rollout.num_servers=3", "orchestration.placement.trainer_nodes=2"])
    assert plan(spec, _nodes(2)).server_nodes == [0, 1, 0]  # no node left: servers share them
    spec = load_spec(None, ["rollout.num_servers=2", "orchestration.placement.trainer_nodes=2",
                            "orchestration.placement.server_nodes=[1, 2]"])
    p = plan(spec, _nodes(3))
    assert p.trainer_nodes == [0, 1] and p.server_nodes == [1, 2]
    assert [node_queue(n) for n in p.server_nodes] == ["node-1", "node-2"]


def test_impossible_placements_name_the_field():
    with pytest.raises(ValueError, match="placement.trainer_nodes is 3 but the provider gave 2"):
        plan(load_spec(None, ["orchestration.placement.trainer_nodes=3"]), _nodes(2))
    with pytest.raises(ValueError, match=r"placement.server_nodes \[5\]: nodes are 0..1"):
        plan(load_spec(None, ["orchestration.placement.server_nodes=[5]"]), _nodes(2))


def test_static_provider_reads_the_deployments_node_list():
    inv = StaticNodeProvider("10.0.0.5:8, 10.0.0.6:8").provision(7, {})
    assert [(n.address, n.gpus) for n in inv.nodes] == [("10.0.0.5", 8), ("10.0.0.6", 8)]
    with pytest.raises(RuntimeError, match="OOLONG_STATIC_NODES"):
        StaticNodeProvider("").provision(7, {})


class _Tracker:
    """The web app's answers about the run: its last trained step, as a trainer reports."""

    def __init__(self, steps):
        self.steps = steps  # a function of the seconds since the start

    def run_info(self) -> dict:
        import time

        return {"last_step": self.steps(time.monotonic() - self.start)}


def _supervised(monkeypatch, steps, timeout_s: float):
    import time
    from uuid import uuid4

    from orchestration.placed import PlacedProcess, PlacedRun, Placement

    spec = load_spec(None, [f"orchestration.heartbeat_timeout_s={timeout_s}"])
    run = PlacedRun(1, "http://web", "token", spec, _nodes(2), Placement([0], []), "pool")
    run.trainers = [PlacedProcess("trainer node 0 on node-0", 0, uuid4())]
    monkeypatch.setattr(PlacedRun, "_state", lambda self, p: ("RUNNING", ""))
    tracker = _Tracker(steps)
    tracker.start = time.monotonic()
    outcome = run.supervise(tracker, poll_s=0.02)
    return outcome, time.monotonic() - tracker.start


def test_a_resumed_trainer_may_start_slowly_but_then_must_keep_stepping(monkeypatch):
    """A resumed run's tracker already has the last attempt's steps: the progress clock starts
    at this attempt's first new step, not at the old ones (a slow checkpoint download on a
    fresh node once failed a resume as 'made no progress')."""
    outcome, took = _supervised(monkeypatch, lambda t: 7 if t < 1.0 else 8, timeout_s=0.3)
    assert outcome.status == "failed" and "made no progress for 0s" in outcome.reason
    assert "trainer node 0 on node-0" in outcome.reason
    assert 1.2 <= took < 3.0, took  # not at 0.3 s on the old step 7; 0.3 s after step 8


def test_a_fresh_trainer_that_stops_stepping_fails_the_run(monkeypatch):
    outcome, took = _supervised(monkeypatch, lambda t: None if t < 0.5 else (1 if t < 0.7 else 2),
                                timeout_s=0.3)
    assert outcome.status == "failed" and took >= 0.9
