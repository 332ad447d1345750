"""Node deployments name the installed package's flows, never a path of the control machine."""

from __future__ import annotations

import json
from pathlib import Path

from orchestration.deployments import node_deployments
from prefect.flows import load_flow_from_entrypoint

ROOT = Path(__file__).resolve().parents[2]


def test_node_deployments_reference_installed_entrypoints_only():
    deployments = node_deployments("oolong-run-7")
    assert [d.entrypoint for d in deployments] == [
        "orchestration.flows.node_processes.rollout_server",
        "orchestration.flows.node_processes.trainer_node",
        "orchestration.flows.node_processes.warm_start_node"]
    for d in deployments:
        assert d.storage is None and d._path is None  # no pull step, no working directory
        assert d.work_pool_name == "oolong-run-7" and d.name == "oolong-run-7"
        # nothing of this checkout travels to the node
        blob = json.dumps({"job_variables": d.job_variables, "entrypoint": d.entrypoint})
        assert str(ROOT) not in blob
        # and the entrypoint is what a node's worker loads from its own install
        assert load_flow_from_entrypoint(d.entrypoint).name == d.flow_name
