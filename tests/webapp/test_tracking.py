import pytest
from rest_framework.test import APIClient

from webapp.tracking.models import LatestMetric, MetricPoint
from webapp.tracking.selectors import metric_series_get
from webapp.tracking.services import metrics_ingest

pytestmark = pytest.mark.django_db


def _points(steps, key="reward/mean", f=lambda s: s / 10):
    return [{"key": key, "step": s, "value": f(s), "time": 1000.0 + s} for s in steps]


def test_ingest_is_idempotent_and_tracks_latest(run):
    assert metrics_ingest(run=run, points=_points(range(10))) == 10
    assert metrics_ingest(run=run, points=_points(range(10))) == 0  # a retried batch
    assert metrics_ingest(run=run, points=_points(range(5, 15))) == 5
    assert MetricPoint.objects.filter(run=run).count() == 15
    latest = LatestMetric.objects.get(run=run, key="reward/mean")
    assert latest.step == 14 and latest.value == pytest.approx(1.4)
    metrics_ingest(run=run, points=_points([3]))  # an old point does not move "latest" back
    assert LatestMetric.objects.get(run=run, key="reward/mean").step == 14


def test_a_step_twice_in_one_batch_keeps_the_later_point(run, ingest_token):
    """Found by the API fuzzer: PostgreSQL's insert refused a batch holding one step twice with
    two values (a 500)."""
    from rest_framework.test import APIClient

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {ingest_token}")
    twice = [{"key": "loss", "step": 4, "value": 1.0}, {"key": "loss", "step": 4, "value": 2.0}]
    resp = c.post("/api/ingest/metrics/", {"points": twice}, format="json")
    assert resp.status_code == 200 and resp.json() == {"inserted": 1, "received": 2}
    assert MetricPoint.objects.get(run=run, key="loss", step=4).value == 2.0
    assert LatestMetric.objects.get(run=run, key="loss").value == 2.0


def test_a_resumed_run_replaces_the_points_of_the_steps_it_trains_again(run):
    assert metrics_ingest(run=run, points=_points(range(6))) == 6  # attempt 1 dies after step 5
    # attempt 2 resumes from the step-3 checkpoint: steps 4 and 5 again, with new values
    assert metrics_ingest(run=run, points=_points(range(4, 8), f=lambda s: -s)) == 4
    assert metrics_ingest(run=run, points=_points(range(4, 8), f=lambda s: -s)) == 0  # retried
    values = dict(MetricPoint.objects.filter(run=run).values_list("step", "value"))
    assert values == {0: 0.0, 1: 0.1, 2: 0.2, 3: 0.3, 4: -4.0, 5: -5.0, 6: -6.0, 7: -7.0}
    assert LatestMetric.objects.get(run=run, key="reward/mean").value == -7.0


def test_nan_points_are_skipped_and_bad_points_named(run):
    from webapp.core.errors import ApplicationError

    assert metrics_ingest(run=run, points=[{"key": "loss", "step": 1, "value": float("nan")}]) == 0
    with pytest.raises(ApplicationError) as err:
        metrics_ingest(run=run, points=[{"key": "loss", "step": "x", "value": 1}])
    assert err.value.errors[0]["field"] == "points[0].step"


def test_series_downsampling_min_max_mean(run):
    metrics_ingest(run=run, points=_points(range(1000), f=lambda s: float(s % 10)))
    full = metric_series_get(run=run, key="reward/mean", buckets=5000)
    assert not full["downsampled"] and len(full["step"]) == 1000
    down = metric_series_get(run=run, key="reward/mean", buckets=100)
    assert down["downsampled"] and len(down["step"]) == 100
    assert down["min"][0] == 0.0 and down["max"][0] == 9.0 and down["mean"][0] == pytest.approx(4.5)
    assert down["step"] == sorted(down["step"]) and down["step"][-1] == 999


def test_ingest_api_with_run_token_and_isolation(run, ingest_token, api):
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {ingest_token}")
    r = c.post("/api/ingest/metrics/", {"points": _points(range(3))}, format="json")
    assert r.json() == {"inserted": 3, "received": 3}
    assert c.post("/api/ingest/status/", {"status": "running"}, format="json").json()["status"] == "running"
    ev = {"kind": "log", "message": "hello", "dedup_key": "k1"}
    assert c.post("/api/ingest/events/", {"events": [ev, ev]}, format="json").json()["stored"] == 1
    samples = [{"step": 2, "prompt": "1+1=", "completion": "2", "reward": 1.0, "tokens": ["2"],
                "token_versions": [1]}]
    assert c.post("/api/ingest/trajectories/", {"samples": samples}, format="json").json()["stored"] == 1
    # the user-facing reads see it
    series = api.get(f"/api/runs/{run.id}/metrics/?keys=reward/mean").json()["series"][0]
    assert series["step"] == [0, 1, 2]
    assert api.get(f"/api/runs/{run.id}/trajectories/").json()[0]["token_versions"] == [1]
    # a wrong token is refused; a user token cannot post to ingest
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Bearer nope")
    assert bad.post("/api/ingest/metrics/", {"points": []}, format="json").status_code == 401
    assert api.post("/api/ingest/metrics/", {"points": []}, format="json").status_code in (401, 403)


def test_compare_api(api, project, alice, dataset_version, reward_version, run):
    from webapp.runs.services import run_create

    other = run_create(project=project, user=alice, name="r2", dataset_version=dataset_version,
                       reward_version=reward_version, spec={"trainer": {"steps": 9}})
    metrics_ingest(run=run, points=_points(range(5)))
    metrics_ingest(run=other, points=_points(range(5), f=lambda s: 1.0))
    body = api.get(f"/api/runs/compare/?ids={run.id},{other.id}&keys=reward/mean").json()
    # The names differ too, but a name is a label, not configuration.
    assert {r["key"] for r in body["config_diff"] if r["differs"]} == {"trainer.steps"}
    assert body["latest"][str(other.id)]["reward/mean"] == 1.0
    # One run alone: its curves and its summary row (a run against nothing, or its sweep).
    alone = api.get(f"/api/runs/compare/?ids={run.id}")
    assert alone.status_code == 200 and [r["run_id"] for r in alone.json()["summary"]["rows"]] == [run.id]
    assert api.get("/api/runs/compare/?ids=").status_code == 400
