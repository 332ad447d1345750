"""Sweeps through the REST API: created and queued through the same path as any run, every
combination checked before anything is stored, compared with a summary; and the run form's
spec schema and spec check."""

from __future__ import annotations

import pytest

from webapp.runs.models import Run
from webapp.sweeps.models import Sweep
from webapp.tracking.services import metrics_ingest

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch):
    """The Celery tasks the web app sends (the in-memory broker has no consumer in unit tests)."""
    from webapp.config import celery

    calls: list[tuple[str, list]] = []
    monkeypatch.setattr(celery.app, "send_task", lambda name, args: calls.append((name, args)))
    return calls


def _body(project, dataset_version, reward_version, **extra):
    return {"project": project.id, "name": "eta", "dataset_version": dataset_version.id,
            "reward_version": reward_version.id, "spec": {"trainer": {"steps": 7}},
            "axes": [{"field": "rollout.max_staleness", "values": [0, 1, 2, 4]}], **extra}


def test_a_staleness_sweep_creates_and_queues_one_run_per_value(
        api, project, dataset_version, reward_version, sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        resp = api.post("/api/sweeps/", _body(project, dataset_version, reward_version), format="json")
    assert resp.status_code == 201, resp.json()
    body = resp.json()
    runs = body["runs"]
    assert [r["sweep_values"] for r in runs] == [{"rollout.max_staleness": v} for v in (0, 1, 2, 4)]
    assert [r["name"] for r in runs] == [f"eta max_staleness={v}" for v in (0, 1, 2, 4)]
    stored = Run.objects.filter(sweep_id=body["id"]).order_by("id")
    assert [r.spec["rollout"]["max_staleness"] for r in stored] == [0, 1, 2, 4]
    assert all(r.spec["trainer"]["steps"] == 7 and r.status == "queued" for r in stored)
    # The same orchestration path as one run: oolong.run_submit per run, after the commit.
    assert sent == [("oolong.run_submit", [r.id]) for r in stored]

    listed = api.get("/api/sweeps/", {"project": project.id}).json()
    assert [s["id"] for s in listed["results"]] == [body["id"]]
    assert api.get(f"/api/sweeps/{body['id']}/").json()["axes"] == body["axes"]


def test_two_axes_make_the_cross_product(api, project, dataset_version, reward_version, sent):
    body = _body(project, dataset_version, reward_version, axes=[
        {"field": "rollout.max_staleness", "values": [0, 2]},
        {"field": "algorithm.preset", "values": ["grpo", "dapo"]}])
    runs = api.post("/api/sweeps/", body, format="json").json()["runs"]
    picked = [(r["sweep_values"]["rollout.max_staleness"], r["sweep_values"]["algorithm.preset"])
              for r in runs]
    assert picked == [(0, "grpo"), (0, "dapo"), (2, "grpo"), (2, "dapo")]
    assert runs[1]["name"] == "eta max_staleness=0 preset=dapo"


@pytest.mark.parametrize(("axes", "field"), [
    ([{"field": "rollout.max_staleness", "values": [0, -1, 2]}], "axes[0].values[1]"),
    ([{"field": "algorithm.preset", "values": ["grpo", "ppo9"]}], "axes[0].values[1]"),
    ([{"field": "trainer.lrr", "values": [1]}], "axes[0].field"),
    ([{"field": "name", "values": ["a", "b"]}], "axes[0].field"),
    ([{"field": "trainer.lr", "values": [0.1, 0.1]}], "axes[0].values"),
    ([{"field": "trainer.lr", "values": [{"a": 1}]}], "axes[0].values[0]"),
    ([{"field": "trainer.lr", "values": list(range(1, 9))},
      {"field": "trainer.steps", "values": [1, 2, 3, 4]}], "axes"),
    ([], "axes"),
])
def test_a_bad_axis_is_a_400_naming_it_and_nothing_is_stored(api, project, dataset_version,
                                                             reward_version, sent, axes, field):
    resp = api.post("/api/sweeps/", _body(project, dataset_version, reward_version, axes=axes),
                    format="json")
    assert resp.status_code == 400, resp.json()
    assert field in [e["field"] for e in resp.json()["errors"]], resp.json()
    assert not Sweep.objects.exists() and not Run.objects.exists() and not sent


def test_infrastructure_axes_are_for_administrators(api, project, dataset_version, reward_version):
    resp = api.post("/api/sweeps/", _body(project, dataset_version, reward_version, axes=[
        {"field": "orchestration.provider", "values": ["local", "static"]}]), format="json")
    assert resp.status_code == 403 and "orchestration.provider" in resp.json()["message"]
    assert not Run.objects.exists()


def test_another_users_sweep_is_a_404(api, bob_api, project, dataset_version, reward_version):
    sweep = api.post("/api/sweeps/", _body(project, dataset_version, reward_version), format="json")
    sweep_id = sweep.json()["id"]
    assert bob_api.get(f"/api/sweeps/{sweep_id}/").status_code == 404
    assert bob_api.get(f"/api/sweeps/{sweep_id}/compare/").status_code == 404
    assert bob_api.get("/api/sweeps/").json()["count"] == 0


def test_compare_with_synchronous_from_a_run(api, run, sent):
    """Two fresh runs of the run's configuration, at its staleness bound and at 0."""
    resp = api.post(f"/api/runs/{run.id}/sweep/",
                    {"axes": [{"field": "rollout.max_staleness", "values": [2, 0]}]}, format="json")
    assert resp.status_code == 201, resp.json()
    runs = Run.objects.filter(sweep_id=resp.json()["id"]).order_by("id")
    assert [r.spec["rollout"]["max_staleness"] for r in runs] == [2, 0]
    for new in runs:  # everything else as the original: dataset, reward, spec
        assert (new.dataset_version_id, new.reward_version_id) == (run.dataset_version_id,
                                                                   run.reward_version_id)
        assert new.spec["trainer"] == run.spec["trainer"]


def test_sweep_compare_shows_the_axis_only_and_a_summary(api, project, dataset_version, reward_version):
    body = api.post("/api/sweeps/", _body(project, dataset_version, reward_version, axes=[
        {"field": "rollout.max_staleness", "values": [0, 2]}]), format="json").json()
    for i, r in enumerate(Run.objects.filter(sweep_id=body["id"]).order_by("id")):
        metrics_ingest(run=r, points=[
            {"key": k, "step": s, "value": v, "time": 100.0 + s * (2 - i)}
            for s in range(1, 21)
            for k, v in (("version", s), ("reward/mean", s / 20), ("tokens_per_s", 100 * (i + 1)))])
    cmp = api.get(f"/api/sweeps/{body['id']}/compare/", {"x": "time", "target": 0.5}).json()
    assert [r["key"] for r in cmp["config_diff"] if r["differs"]] == ["rollout.max_staleness"]
    rows = cmp["summary"]["rows"]
    assert [r["tokens_per_s"] for r in rows] == [100.0, 200.0]
    # Same reward per step; the second run takes half the time per step.
    assert rows[0]["step_to_target"] == rows[1]["step_to_target"] == 12
    assert rows[1]["time_to_target_s"] == pytest.approx(rows[0]["time_to_target_s"] / 2)
    assert cmp["series"][str(rows[1]["run_id"])][0]["x"][-1] == pytest.approx(19.0)
    assert api.get(f"/api/sweeps/{body['id']}/compare/", {"x": "minutes"}).status_code == 400
    assert api.get(f"/api/sweeps/{body['id']}/compare/", {"target": "nan"}).status_code == 400


def test_spec_schema_lists_fields_with_help_and_hides_infrastructure_from_members(api, alice):
    fields = {f["path"]: f for f in api.get("/api/runs/spec-schema/").json()["fields"]}
    eta = fields["rollout.max_staleness"]
    assert (eta["kind"], eta["default"], eta["minimum"], eta["common"]) == ("integer", 1, 0, True)
    assert "synchronous" in eta["description"]
    assert fields["model.path"]["choices"] == ["tiny", "smollm2"]  # members: registered models
    assert "orchestration.provider" not in fields and "run_dir" not in fields
    assert "name" not in fields and "data.source" not in fields  # set by the platform
    alice.is_staff = True
    alice.save()
    staff = {f["path"]: f for f in api.get("/api/runs/spec-schema/").json()["fields"]}
    assert staff["orchestration.provider"]["admin"] and staff["model.path"]["kind"] == "string"


def test_spec_check_names_each_bad_field_and_round_trips_yaml(api):
    bad = api.post("/api/runs/spec-check/", {"spec": {"rollout": {"max_staleness": -1},
                                                      "trainer": {"lrr": 1}}}, format="json")
    assert bad.status_code == 200
    errors = {e["field"]: e["message"] for e in bad.json()["errors"]}
    assert not bad.json()["valid"] and set(errors) == {"spec.rollout.max_staleness", "spec.trainer.lrr"}
    assert "greater than or equal to 0" in errors["spec.rollout.max_staleness"]
    good = api.post("/api/runs/spec-check/", {"spec": {"rollout": {"max_staleness": 0}}},
                    format="json").json()
    assert good["valid"] and good["yaml"] == "rollout:\n  max_staleness: 0\n"
    assert good["resolved"]["rollout"]["max_staleness"] == 0
    back = api.post("/api/runs/spec-check/", {"yaml": good["yaml"]}, format="json").json()
    assert back["spec"] == {"rollout": {"max_staleness": 0}}
    broken = api.post("/api/runs/spec-check/", {"yaml": "trainer:\n  steps: [1\n"},
                      format="json").json()
    assert not broken["valid"] and broken["errors"][0]["line"] == 3
    admin = api.post("/api/runs/spec-check/", {"spec": {"orchestration": {"provider": "static"}}},
                     format="json").json()
    assert [e["field"] for e in admin["errors"]] == ["spec.orchestration.provider"]
    assert api.post("/api/runs/spec-check/", {}, format="json").status_code == 400
