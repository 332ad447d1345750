"""Where a run's processes go is the provider's choice, not the node count's: every provider but
``local`` places them on its nodes, one node included (one static or cloud node used to run the
whole run as local subprocesses on the control machine while its URLs named the node)."""

from __future__ import annotations

import logging

import pytest
from orchestration.flows import training_run as flow_module
from orchestration.providers.base import Node, NodeInventory
from orchestration.supervise import Outcome

from training_core.config import load_spec


class _Tracker:
    def __init__(self, url, token):
        self.statuses = []

    def run_info(self):
        return {"spec": {}, "cancel_requested": False}

    def status(self, status, reason=""):
        self.statuses.append(status)

    def event(self, *args, **kwargs):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("provider", ["static", "terraform"])
def test_one_node_of_any_provider_but_local_is_placed(provider, monkeypatch, tmp_path):
    placed, started_here = [], []
    one_node = NodeInventory([Node("10.0.0.5", gpus=1)], meta={"provider": provider})

    class Provider:
        name = provider

        def release(self, run_id):
            pass

    monkeypatch.setenv("OOLONG_INGEST_TOKEN", "flow-token")
    monkeypatch.setenv("OOLONG_RUNS_DIR", str(tmp_path))
    monkeypatch.setattr(flow_module, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(flow_module, "Tracker", _Tracker)
    monkeypatch.setattr(flow_module, "get_provider", lambda name: Provider())
    monkeypatch.setattr(flow_module, "provision_nodes", lambda *a: one_node)
    monkeypatch.setattr(flow_module, "prepare_run", lambda cred, run_dir: (load_spec(), run_dir))
    monkeypatch.setattr(flow_module, "run_placed", lambda run, tracker, resume: Outcome("succeeded"))
    monkeypatch.setattr(flow_module, "start_rollout_fleet",
                        lambda *a: started_here.append("servers") or pytest.fail("ran locally"))
    monkeypatch.setattr(flow_module, "tear_down", lambda procs: None)

    class _Placed:  # what the flow's finally stops
        @staticmethod
        def stop():
            return []

    monkeypatch.setattr(flow_module, "prepare_placed",
                        lambda prov, run_id, cred, spec, inv, tracker: placed.append(inv) or _Placed)
    status = flow_module.training_run.fn(5, provider=provider, tracker_url="http://web")
    assert status == "succeeded"
    assert placed == [one_node] and not started_here
