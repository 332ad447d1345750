"""A sweep on the real stack: created through the API, its runs queued through Celery to the
training-run flow like any run, launched together, starting from one shared warm start."""

from __future__ import annotations

import pytest

from tests.integration.conftest import SMALL_SPEC, run_processes, run_status, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_sweeps_runs_share_one_warm_start_and_both_finish(stack, project_setup):
    from webapp.runs.models import Run, RunEvent

    s = project_setup
    spec = {**SMALL_SPEC, "model": {"path": "tiny", "warm_start_seconds": 300,
                                    "warm_start_steps": 20}}
    resp = s["api"].post("/api/sweeps/", {
        "project": s["project"].id, "name": "shared", "dataset_version": s["dataset_version"].id,
        "reward_version": s["reward_version"].id, "spec": spec,
        "axes": [{"field": "rollout.max_staleness", "values": [0, 2]}]}, format="json")
    assert resp.status_code == 201, resp.json()
    ids = [r["id"] for r in resp.json()["runs"]]
    for run_id in ids:
        wait_for(lambda r=run_id: run_status(r) in ("succeeded", "failed", "cancelled"), 600,
                 f"run {run_id} to end")
    for run in Run.objects.filter(id__in=ids):
        events = list(RunEvent.objects.filter(run=run).values_list("kind", "message"))
        assert run.status == "succeeded", (run.status_reason, events)
        assert any(k == "warm_start" and "shared with the runs of sweep" in m for k, m in events)
    # One warm start for both: one shared model, and each run's copy of it is the same bytes.
    shared = list((stack["runs_dir"] / "sweeps" / f"sweep-{resp.json()['id']}").glob(
        "warm-start-*/model.safetensors"))
    assert len(shared) == 1
    copies = [(stack["runs_dir"] / "flows" / f"run-{i}" / "initial_model" / "model.safetensors")
              for i in ids]
    assert all(c.read_bytes() == shared[0].read_bytes() for c in copies)
    made = [i for i in ids if (stack["runs_dir"] / "flows" / f"run-{i}" / "logs" /
                               "warm-start.log").exists()]
    assert len(made) == 1, "exactly one of the runs ran the warm start"
    for run_id in ids:
        wait_for(lambda r=run_id: not run_processes(r), 60, "every process of the runs to exit")
