"""From "create run" to running processes and back, on the real stack (see conftest)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.conftest import (
    create_run,
    run_processes,
    run_status,
    wait_for,
    wait_for_exit,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _events(run_id: int) -> list[tuple[str, str]]:
    from webapp.runs.models import RunEvent

    return list(RunEvent.objects.filter(run_id=run_id).values_list("kind", "message"))


def _trainer_pid(run_id: int) -> int:
    def find():
        for pid in run_processes(run_id):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"training_core.cli" in cmd and b"train" in cmd:
                return pid
        return None
    return wait_for(find, 120, "the trainer process")


def test_api_to_celery_to_prefect_to_trainer_and_metrics_back(stack, project_setup):
    from webapp.runs.models import Run
    from webapp.tracking.models import MetricPoint

    run_id = create_run(project_setup, "e2e", trainer={"steps": 4, "batch_groups": 2})
    wait_for(lambda: run_status(run_id) in ("succeeded", "failed", "cancelled"), 300, "the run to end")
    run = Run.objects.get(id=run_id)
    assert run.status == "succeeded", (run.status_reason, _events(run_id))
    assert run.orchestrator_ref.startswith("local:")
    steps = sorted(set(MetricPoint.objects.filter(run=run, key="version").values_list("step", flat=True)))
    assert steps == [1, 2, 3, 4]
    kinds = [k for k, _ in _events(run_id)]
    for kind in ("created", "submitted", "fleet", "trainer", "flow"):
        assert kind in kinds
    statuses = [m for k, m in _events(run_id) if k == "status"]
    assert statuses[:3] == ["provisioning", "running", "succeeded"]
    wait_for_exit(run_id, 30, "every process of the run to exit")
    # The run page shows the trainer's metrics.
    page = project_setup["api"].get(f"/api/runs/{run_id}/").json()
    assert page["latest_metrics"]["version"] == 4.0
    from django.test import Client

    c = Client()
    c.force_login(project_setup["user"])
    html = c.get(f"/runs/{run_id}/").content.decode()
    assert "reward/mean" in html and "succeeded" in html

    # Offline evaluation of the final weights, as a worker job.
    from workers.tasks import evaluation_run

    result = evaluation_run.delay(run_id, None, 20).get(timeout=120)
    assert result["version"] == 4 and result["rows"] == 20 and 0.0 <= result["accuracy"] <= 1.0
    assert MetricPoint.objects.filter(run=run, key="offline_eval/accuracy", step=4).exists()


def test_the_trainer_and_servers_hold_no_database_credentials(stack, project_setup):
    run_id = create_run(project_setup, "secrets", trainer={"steps": 200})
    pid = _trainer_pid(run_id)
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    assert not any(e.startswith((b"DATABASE_URL=", b"CELERY_BROKER_URL=")) for e in env)
    project_setup["api"].post(f"/api/runs/{run_id}/cancel/")
    wait_for(lambda: run_status(run_id) == "cancelled", 60, "cancellation")


def test_cancel_from_the_api_stops_every_process_within_30s(stack, project_setup):
    run_id = create_run(project_setup, "cancel-me", trainer={"steps": 500})
    wait_for(lambda: run_status(run_id) == "running", 180, "the run to start")
    _trainer_pid(run_id)
    assert len(run_processes(run_id)) >= 3  # flow, rollout server, trainer (+ reward workers)
    resp = project_setup["api"].post(f"/api/runs/{run_id}/cancel/")
    assert resp.status_code == 202
    start = time.monotonic()
    wait_for(lambda: run_status(run_id) == "cancelled", 30, "status cancelled")
    wait_for_exit(run_id, max(1.0, 30 - (time.monotonic() - start)),
                  "every process of the run to be gone")


def test_trainer_sigkill_fails_the_run_with_that_reason_and_tears_down(stack, project_setup):
    from webapp.runs.models import Run

    run_id = create_run(project_setup, "kill-trainer", trainer={"steps": 500})
    pid = _trainer_pid(run_id)
    wait_for(lambda: run_status(run_id) == "running", 120, "the run to start")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: run_status(run_id) == "failed", 60, "status failed")
    assert Run.objects.get(id=run_id).status_reason.startswith("trainer killed by SIGKILL")
    wait_for_exit(run_id, 30, "teardown")


def test_rollout_server_killed_is_restarted_and_the_run_succeeds(stack, project_setup):
    from webapp.tracking.models import MetricPoint

    run_id = create_run(project_setup, "kill-server", trainer={"steps": 40})

    def server_pid():
        for pid in run_processes(run_id):
            try:
                if b"rollout_server.server" in open(f"/proc/{pid}/cmdline", "rb").read():
                    return pid
            except OSError:
                continue
        return None

    wait_for(lambda: MetricPoint.objects.filter(run_id=run_id, key="version").exists(), 180,
             "the first training step")
    os.kill(wait_for(server_pid, 30, "the rollout server"), signal.SIGKILL)
    wait_for(lambda: run_status(run_id) in ("succeeded", "failed"), 300, "the run to end")
    kinds = [k for k, _ in _events(run_id)]
    assert "rollout_server_restarted" in kinds, _events(run_id)
    from webapp.runs.models import Run

    assert run_status(run_id) == "succeeded", Run.objects.get(id=run_id).status_reason
    versions = sorted(MetricPoint.objects.filter(run_id=run_id, key="version").values_list("step", flat=True))
    assert versions == list(range(1, 41))


def test_web_app_unreachable_for_a_while_loses_no_metric(stack, project_setup):
    from webapp.runs.models import Run
    from webapp.tracking.models import MetricPoint

    run_id = create_run(project_setup, "flaky-web", trainer={"steps": 30})
    wait_for(lambda: MetricPoint.objects.filter(run_id=run_id, key="version").count() >= 3, 180,
             "a few steps")
    stack["proxy"].down()
    during = MetricPoint.objects.filter(run_id=run_id, key="version").count()
    time.sleep(8)
    stack["proxy"].up()
    wait_for(lambda: run_status(run_id) in ("succeeded", "failed"), 300, "the run to end")
    assert run_status(run_id) == "succeeded", Run.objects.get(id=run_id).status_reason
    versions = sorted(MetricPoint.objects.filter(run_id=run_id, key="version").values_list("step", flat=True))
    assert versions == list(range(1, 31)), "no metric lost"
    assert during < 30, "the outage happened while the run was going"
