import pytest

from webapp.core.errors import ApplicationError
from webapp.runs.models import Run
from webapp.runs.selectors import run_config_diff
from webapp.runs.services import run_cancel, run_create, run_status_set, run_token_issue

pytestmark = pytest.mark.django_db


def test_run_create_resolves_spec_and_pins_the_reward(run, reward_version):
    assert run.status == "queued"
    assert run.spec["trainer"]["steps"] == 5 and run.spec["name"] == "r1"
    assert run.spec["reward"]["fn"] == reward_version.fn_path
    assert run.spec["rollout"]["max_staleness"] == 1  # defaults filled in
    assert [e.kind for e in run.events.all()] == ["created"]


def test_invalid_spec_errors_per_field_and_nothing_stored(project, alice, dataset_version, reward_version):
    with pytest.raises(ApplicationError) as err:
        run_create(project=project, user=alice, name="bad", dataset_version=dataset_version,
                   reward_version=reward_version,
                   spec={"trainer": {"lrr": 1, "steps": -3}, "algorithm": {"preset": "ppo9"}})
    fields = {e["field"]: e["message"] for e in err.value.errors}
    assert "spec.trainer.lrr" in fields and "Did you mean 'trainer.lr'" in fields["spec.trainer.lrr"]
    assert "spec.trainer.steps" in fields and "spec.algorithm.preset" in fields
    assert not Run.objects.exists()


def test_pending_reward_cannot_be_used(project, alice, dataset_version):
    from webapp.rewards.services import reward_function_create

    pending = reward_function_create(project=project, user=alice, name="code",
                                     source="def reward(c, i):\n  return 1.0\n")
    with pytest.raises(ApplicationError, match="pending"):
        run_create(project=project, user=alice, name="x", dataset_version=dataset_version,
                   reward_version=pending)


def test_cross_project_objects_are_refused(bob_project, bob, dataset_version, reward_version):
    with pytest.raises(ApplicationError, match="another project"):
        run_create(project=bob_project, user=bob, name="steal", dataset_version=dataset_version,
                   reward_version=reward_version)


def test_lifecycle_transitions(run):
    run = run_status_set(run=run, status="provisioning")
    run = run_status_set(run=run, status="running")
    assert run.started_at is not None
    with pytest.raises(ApplicationError, match="cannot move"):
        run_status_set(run=run, status="queued")
    run = run_status_set(run=run, status="failed", reason="trainer killed (SIGKILL)")
    assert run.finished_at and run.status_reason == "trainer killed (SIGKILL)"
    # Terminal is final: a late "succeeded" report is ignored.
    assert run_status_set(run=run, status="succeeded").status == "failed"
    assert [e.kind for e in run.events.all()] == ["created", "status", "status", "status"]


def test_cancel_queued_run_is_immediate(run, alice):
    run = run_cancel(run=run, user=alice)
    assert run.status == "cancelled" and run.cancel_requested
    with pytest.raises(ApplicationError, match="already cancelled"):
        run_cancel(run=run, user=alice)


def test_cancel_running_run_is_requested(run, alice):
    run_status_set(run=run, status="running")
    run = run_cancel(run=run, user=alice)
    assert run.status == "running" and run.cancel_requested


def test_config_diff_puts_differences_first(project, alice, dataset_version, reward_version):
    a = run_create(project=project, user=alice, name="a", dataset_version=dataset_version,
                   reward_version=reward_version, spec={"trainer": {"lr": 0.001}})
    b = run_create(project=project, user=alice, name="b", dataset_version=dataset_version,
                   reward_version=reward_version, spec={"trainer": {"lr": 0.002}})
    diff = run_config_diff(runs=[a, b])
    differing = [r["key"] for r in diff if r["differs"]]
    assert set(differing) == {"trainer.lr"}  # the names differ too, but a name is a label
    assert "name" not in {r["key"] for r in diff}
    assert diff[0]["differs"] and not diff[-1]["differs"]


def test_runs_api_create_list_filter_cancel_and_isolation(api, bob_api, project, dataset_version, reward_version):
    body = {"project": project.id, "name": "api-run", "dataset_version": dataset_version.id,
            "reward_version": reward_version.id, "spec": {"trainer": {"steps": 3}}}
    r = api.post("/api/runs/", body, format="json")
    assert r.status_code == 201, r.json()
    run_id = r.json()["id"]
    assert r.json()["ingest_token"]
    listing = api.get("/api/runs/?status=queued").json()
    assert listing["count"] == 1 and listing["results"][0]["name"] == "api-run"
    assert api.get("/api/runs/?status=running").json()["count"] == 0
    assert bob_api.get(f"/api/runs/{run_id}/").status_code == 404
    assert bob_api.post(f"/api/runs/{run_id}/cancel/").status_code == 404
    assert api.post(f"/api/runs/{run_id}/cancel/").json()["status"] == "cancelled"
    bad = api.post("/api/runs/", {**body, "spec": {"rollout": {"max_staleness": -1}}}, format="json")
    assert bad.status_code == 400
    assert bad.json()["errors"][0]["field"] == "spec.rollout.max_staleness"


def test_unauthenticated_requests_are_refused(client, run):
    from rest_framework.test import APIClient

    assert APIClient().get("/api/runs/").status_code == 401


def test_openapi_schema_and_docs(api):
    schema = api.get("/api/schema/?format=json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for p in ["/api/runs/", "/api/runs/{run_id}/cancel/", "/api/datasets/", "/api/rewards/",
              "/api/runs/{run_id}/metrics/", "/api/ingest/metrics/"]:
        assert p in paths, p
    assert {"get", "post"} <= set(paths["/api/runs/"])
    docs = api.get("/api/docs/")
    assert docs.status_code == 200 and b"cdn" not in docs.content.lower()


@pytest.mark.parametrize("url", ["/api/runs/?project=abc", "/api/datasets/?project=abc",
                                 "/api/rewards/?project=1x"])
def test_bad_query_parameters_are_400s_naming_the_field(api, url):
    r = api.get(url)
    assert r.status_code == 400 and r.json()["errors"][0]["field"] == "project"


def test_dashboard_run_list_ignores_a_bad_project_filter(client, alice, run):
    client.force_login(alice)
    r = client.get("/?project=abc&status=queued")
    assert r.status_code == 200 and b"r1" in r.content


def test_built_in_datasets_ship_their_prompt_template(project, alice, reward_version):
    from webapp.datasets.services import dataset_create_builtin

    gsm = dataset_create_builtin(project=project, user=alice, name="gsm", builtin="gsm_symbolic",
                                 size=5)
    run = run_create(project=project, user=alice, name="g", dataset_version=gsm,
                     reward_version=reward_version)
    assert run.spec["data"]["prompt_template"] == "gsm8k"  # asks for '#### N', gsm8k extracts it
    own = run_create(project=project, user=alice, name="own", dataset_version=gsm,
                     reward_version=reward_version, spec={"data": {"prompt_template": "Q: {question}"}})
    assert own.spec["data"]["prompt_template"] == "Q: {question}"


def test_resume_a_failed_or_cancelled_run_as_a_new_attempt(api, run, django_capture_on_commit_callbacks):
    from webapp.runs.models import RunEvent, RunToken

    run_status_set(run=run, status="running")
    run_token_issue(run=run, purpose="orchestrator")
    run_status_set(run=run, status="failed", reason="node-2 gone")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        resp = api.post(f"/api/runs/{run.id}/resume/")
    assert resp.status_code == 202, resp.json()
    run.refresh_from_db()
    assert (run.status, run.attempt, run.status_reason, run.finished_at) == ("queued", 2, "", None)
    assert len(callbacks) == 1, "run_submit is enqueued once the resume commits"
    assert RunEvent.objects.filter(run=run, kind="resume_requested").exists()
    assert RunToken.objects.get(purpose="orchestrator").revoked_at, \
        "the failed attempt's token stays void (the new attempt gets its own at submission)"
    again = api.post(f"/api/runs/{run.id}/resume/")  # queued: nothing to resume
    assert again.status_code == 409 and "this one is queued" in again.json()["message"]
    run_status_set(run=run, status="running")
    run_status_set(run=run, status="succeeded")
    assert api.post(f"/api/runs/{run.id}/resume/").status_code == 409


def test_the_web_app_reads_a_fields_default_from_the_schema_not_its_own(run):
    """A stored spec without rollout.max_staleness (an older run, a hand-made row) read 0 in the
    dashboard and the "compare with synchronous" sweep, while the trainer ran it at the schema's
    default 1."""
    from training_core.config import RunSpec
    from webapp.runs.selectors import run_spec_resolved
    from webapp.sweeps.services import sweep_against_synchronous

    del run.spec["rollout"]["max_staleness"]
    run.save(update_fields=["spec"])
    default = RunSpec().rollout.max_staleness
    assert default == 1 and run_spec_resolved(run=run).rollout.max_staleness == default
    sweep = sweep_against_synchronous(run=run, user=run.created_by)
    values = sorted(r.spec["rollout"]["max_staleness"] for r in sweep.runs.all())
    assert values == [0, default]
