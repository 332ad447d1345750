"""Runs on Terraform-provisioned nodes: destroy always runs (success, failed apply, cancel)."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import (
    create_run,
    run_status,
    wait_for,
    wait_for_exit,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
TF_VARS = {"region": "us-east-1", "availability_zone": "us-east-1a", "instance_type": "g5.xlarge",
           "node_count": 1, "prefect_api_url": "https://prefect.example/api"}


def _tf_calls(stack, run_id: int) -> list[str]:
    path = stack["tf_log"]
    if not path.exists():
        return []
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    return [c["argv"][0] for c in calls if f"run-{run_id}" in c["cwd"]]


def _terraform_run(setup, name, steps, **tf):
    setup["user"].is_staff = True  # infrastructure fields are for administrators
    setup["user"].save()
    return create_run(setup, name, trainer={"steps": steps},
                      orchestration={"provider": "terraform", "terraform_vars": {**TF_VARS, **tf}})


def test_run_on_terraform_nodes_succeeds_and_destroys(stack, project_setup):
    run_id = _terraform_run(project_setup, "tf-ok", 3)
    wait_for(lambda: run_status(run_id) in ("succeeded", "failed"), 300, "the run to end")
    from webapp.runs.models import Run

    assert run_status(run_id) == "succeeded", Run.objects.get(id=run_id).status_reason
    assert _tf_calls(stack, run_id) == ["init", "apply", "output", "destroy"]


def test_apply_failing_half_way_fails_the_run_and_still_destroys(stack, project_setup):
    from webapp.runs.models import Run

    run_id = _terraform_run(project_setup, "tf-fail", 3, instance_type="fake.fail-apply")
    wait_for(lambda: run_status(run_id) == "failed", 180, "the run to fail")
    assert "InsufficientInstanceCapacity" in Run.objects.get(id=run_id).status_reason
    assert _tf_calls(stack, run_id) == ["init", "apply", "destroy"]


def test_cancelled_run_destroys_its_nodes(stack, project_setup):
    run_id = _terraform_run(project_setup, "tf-cancel", 500)
    wait_for(lambda: run_status(run_id) == "running", 180, "the run to start")
    project_setup["api"].post(f"/api/runs/{run_id}/cancel/")
    wait_for(lambda: run_status(run_id) == "cancelled", 30, "cancellation")
    wait_for(lambda: "destroy" in _tf_calls(stack, run_id), 30, "terraform destroy")
    wait_for_exit(run_id, 30, "teardown")
