"""Web-side orchestration services that need no flow: reconcile and idempotent submission."""

import subprocess

import pytest

from webapp.runs.models import Run
from webapp.runs.orchestration import runs_reconcile
from webapp.runs.services import run_status_set

pytestmark = pytest.mark.django_db


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_reconcile_fails_runs_whose_flow_vanished(run):
    run_status_set(run=run, status="running")
    Run.objects.filter(id=run.id).update(orchestrator_ref=f"local:{_dead_pid()}")
    assert runs_reconcile() == 1
    run.refresh_from_db()
    assert run.status == "failed" and "orchestrator lost the run" in run.status_reason
    assert runs_reconcile() == 0  # terminal runs are left alone


def test_reconcile_leaves_live_flows_alone(run):
    import os

    run_status_set(run=run, status="running")
    Run.objects.filter(id=run.id).update(orchestrator_ref=f"local:{os.getpid()}")
    assert runs_reconcile() == 0
    run.refresh_from_db()
    assert run.status == "running"


def test_submission_is_idempotent(run, monkeypatch):
    from webapp.runs import orchestration

    calls = []
    monkeypatch.setattr("orchestration.trigger.submit_training_run",
                        lambda **kw: calls.append(kw) or "local:12345")
    assert orchestration.run_submit_to_orchestrator(run_id=run.id) == "local:12345"
    assert orchestration.run_submit_to_orchestrator(run_id=run.id) == "local:12345"  # a retried task
    assert len(calls) == 1
