"""Runs on Terraform-provisioned nodes: the run is placed on its node (one node included) once
the node comes up, and destroy always runs (success, failed apply, cancel).

The stand-in ``terraform`` (tests/orchestration/fake_terraform.py) boots each node as its
cloud-init would leave it (``OOLONG_FAKE_TF_BOOT``): it checks the build it was given against
the store by hash, and starts a Prefect worker on the node's queue of the run's pool with the
run's node key and the Prefect credential, against a Prefect server that requires it. The bucket
is a folder (``OOLONG_TERRAFORM_STORE_URL``: no S3 here)."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import (
    create_run,
    run_status,
    wait_for,
    wait_for_exit,
)
from tests.integration.prefect_cluster import kill, start_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
TF_VARS = {"region": "us-east-1", "availability_zone": "us-east-1a", "instance_type": "g5.xlarge",
           "node_count": 1, "checkpoint_bucket": "ckpt-bucket"}
AUTH = "oolong:" + secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """One authenticated Prefect server for the module's runs (each has its own pool)."""
    procs: list[subprocess.Popen] = []
    try:
        api, _ = start_server(tmp_path_factory.mktemp("prefect"), "oolong_prefect_tf_runs",
                              procs, auth=AUTH)
        yield api
    finally:
        for proc in procs:
            kill(proc)


@pytest.fixture
def cloud(prefect_api, tmp_path, monkeypatch):
    """What the web app's stack passes on to the flow (set before the stack starts)."""
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", AUTH)
    monkeypatch.setenv("OOLONG_TERRAFORM_STORE_URL", (tmp_path / "bucket").as_uri())
    monkeypatch.setenv("OOLONG_FAKE_TF_BOOT", "1")
    # the nodes' Python: this venv's, by its real path (the reward jail mounts the real one)
    monkeypatch.setenv("OOLONG_FAKE_TF_PYTHON", str(Path(sys.prefix).resolve() / "bin" / "python"))
    return {"api": prefect_api, "bucket": tmp_path / "bucket"}


def _tf_calls(stack, run_id: int) -> list[str]:
    path = stack["tf_log"]
    if not path.exists():
        return []
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    return [c["argv"][0] for c in calls if f"run-{run_id}" in c["cwd"]]


def _terraform_run(setup, cloud, name, steps, **tf):
    setup["user"].is_staff = True  # infrastructure fields are for administrators
    setup["user"].save()
    return create_run(setup, name, trainer={"steps": steps},
                      orchestration={"provider": "terraform", "nodes_online_timeout_s": 120,
                                     "terraform_vars": {**TF_VARS, "prefect_api_url": cloud["api"],
                                                        **tf}})


def test_a_one_node_run_on_terraform_nodes_is_placed_there_and_destroyed(cloud, stack,
                                                                         project_setup):
    run_id = _terraform_run(project_setup, cloud, "tf-ok", 3)
    wait_for(lambda: run_status(run_id) in ("succeeded", "failed"), 400, "the run to end")
    from webapp.runs.models import Run, RunEvent

    assert run_status(run_id) == "succeeded", Run.objects.get(id=run_id).status_reason
    assert _tf_calls(stack, run_id) == ["init", "apply", "output", "destroy"]
    # its processes ran on the node, from the model the flow put in the run's store
    node_run = (stack["env"]["OOLONG_TERRAFORM_WORKSPACES"] + f"/run-{run_id}/nodes/node-0/runs/"
                f"flows/run-{run_id}")
    logs = {p.name for p in Path(node_run, "logs").glob("*.log")}
    assert {"trainer.log", "rollout-server-0.log"} <= logs, logs
    assert (cloud["bucket"] / f"run-{run_id}" / "model" / "COMPLETE").exists()
    assert RunEvent.objects.filter(run_id=run_id, kind="placement").exists()
    wait_for_exit(run_id, 60, "every process of the run to exit")


def test_apply_failing_half_way_fails_the_run_and_still_destroys(cloud, stack, project_setup):
    from webapp.runs.models import Run

    run_id = _terraform_run(project_setup, cloud, "tf-fail", 3, instance_type="fake.fail-apply")
    wait_for(lambda: run_status(run_id) == "failed", 180, "the run to fail")
    assert "InsufficientInstanceCapacity" in Run.objects.get(id=run_id).status_reason
    assert _tf_calls(stack, run_id) == ["init", "apply", "destroy"]


def test_cancelled_run_destroys_its_nodes(cloud, stack, project_setup):
    run_id = _terraform_run(project_setup, cloud, "tf-cancel", 500)
    wait_for(lambda: run_status(run_id) == "running", 300, "the run to start")
    project_setup["api"].post(f"/api/runs/{run_id}/cancel/")
    wait_for(lambda: run_status(run_id) == "cancelled", 60, "cancellation")
    wait_for(lambda: "destroy" in _tf_calls(stack, run_id), 60, "terraform destroy")
    wait_for_exit(run_id, 30, "teardown")
