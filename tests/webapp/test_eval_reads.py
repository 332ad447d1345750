"""The evaluation reads (issue 48): the run page's panel (each eval set, each metric, its 95%
interval and the weight version evaluated) and the compare view's time to a target accuracy,
interpolated between the two evaluations that straddle it."""

from __future__ import annotations

import pytest

from webapp.tracking.selectors import run_eval_series, runs_eval_compare
from webapp.tracking.services import metrics_ingest

pytestmark = pytest.mark.django_db

START = 1010.0  # the wall time of every run's first step (its first version point)


def _steps(run, steps: int) -> None:
    """A trainer's steps 1..steps: 10 s and 100 tokens each."""
    metrics_ingest(run=run, points=[
        {"key": key, "step": s, "value": value, "time": 1000.0 + 10 * s}
        for s in range(1, steps + 1) for key, value in (("version", s), ("tokens/consumed", 100))])


def _evals(run, values: dict[int, float], set_name: str = "heldout", metric: str = "greedy_accuracy",
           half_width: float = 0.1) -> None:
    points = []
    for s, v in values.items():
        for suffix, value in (("", v), ("_ci_lo", v - half_width), ("_ci_hi", v + half_width)):
            points.append({"key": f"eval/{set_name}/{metric}{suffix}", "step": s, "value": value,
                           "time": 1000.0 + 10 * s})
        points.append({"key": f"eval/{set_name}/version", "step": s, "value": s - 1,
                       "time": 1000.0 + 10 * s})
    metrics_ingest(run=run, points=points)


@pytest.fixture
def runs(run, project, alice, dataset_version, reward_version):
    from webapp.runs.services import run_create

    b, c = (run_create(project=project, user=alice, name=name, dataset_version=dataset_version,
                       reward_version=reward_version, spec={}) for name in ("b", "c"))
    for r in (run, b, c):
        _steps(r, 10)
    _evals(run, {2: 0.2, 4: 0.4, 6: 0.6})
    _evals(b, {2: 0.1, 4: 0.3})
    return run, b, c  # c has no evaluation


def test_the_panel_has_each_set_and_metric_with_its_interval_and_version(run):
    _steps(run, 10)
    _evals(run, {2: 0.25, 4: 0.5})
    _evals(run, {2: 0.5, 4: 0.75}, metric="pass@k")
    _evals(run, {4: 0.125}, set_name="algebra")
    curves = run_eval_series(run=run, x="time")
    assert [(c["set"], c["metric"]) for c in curves] == [
        ("heldout", "greedy_accuracy"), ("heldout", "pass@k"), ("algebra", "greedy_accuracy")]
    held = curves[0]
    assert held["step"] == [2, 4] and held["value"] == [0.25, 0.5]
    assert held["lo"] == [pytest.approx(0.15), pytest.approx(0.4)]
    assert held["hi"] == [pytest.approx(0.35), pytest.approx(0.6)]
    assert held["version"] == [1, 3]
    assert held["x"] == [10.0, 30.0]  # seconds since the first step
    assert curves[1]["value"] == [0.5, 0.75] and curves[2]["step"] == [4]


def test_a_run_without_evals_has_an_empty_panel(run):
    _steps(run, 3)
    assert run_eval_series(run=run) == []


def test_the_target_is_reached_between_the_two_evaluations_that_straddle_it(runs):
    a, b, c = runs
    got = runs_eval_compare(runs=list(runs), x="tokens", target=0.5)
    rows = {r["run_id"]: r for r in got["rows"]}
    # a: 0.4 at step 4 (30 s, 400 tokens), 0.6 at step 6 (50 s, 600 tokens): halfway.
    assert rows[a.id]["reached"] is True
    assert rows[a.id]["step_to_target"] == pytest.approx(5.0)
    assert rows[a.id]["minutes_to_target"] == pytest.approx(40.0 / 60)
    assert rows[a.id]["tokens_to_target"] == pytest.approx(500.0)
    assert rows[a.id]["final"] == 0.6 and rows[a.id]["final_step"] == 6
    assert rows[a.id]["final_ci"] == [pytest.approx(0.5), pytest.approx(0.7)]
    # b ends at 0.3: not reached; c never evaluated.
    assert rows[b.id]["reached"] is False and rows[b.id]["minutes_to_target"] is None
    assert (rows[c.id]["evals"], rows[c.id]["final"], rows[c.id]["reached"],
            rows[c.id]["step_to_target"], rows[c.id]["tokens_to_target"]) == (0, None, False,
                                                                               None, None)
    assert got["series"][a.id]["x"] == [200.0, 400.0, 600.0]  # tokens consumed by each eval
    assert got["series"][c.id]["step"] == []


def test_the_default_target_is_the_lowest_final_accuracy(runs):
    a, b, _ = runs
    got = runs_eval_compare(runs=list(runs))
    assert got["target"] == 0.3 and got["set"] == "heldout"
    rows = {r["run_id"]: r for r in got["rows"]}
    # a: between 0.2 (step 2, 10 s, 200 tokens) and 0.4 (step 4, 30 s, 400): halfway.
    assert rows[a.id]["step_to_target"] == pytest.approx(3.0)
    assert rows[a.id]["minutes_to_target"] == pytest.approx(20.0 / 60)
    assert rows[a.id]["tokens_to_target"] == pytest.approx(300.0)
    # b reaches it at its last evaluation exactly.
    assert (rows[b.id]["step_to_target"], rows[b.id]["minutes_to_target"]) == (4.0, 0.5)


def test_a_first_evaluation_already_at_the_target_is_its_own_time(runs):
    a = runs[0]
    row = runs_eval_compare(runs=[a], target=0.1)["rows"][0]
    assert (row["step_to_target"], row["minutes_to_target"], row["tokens_to_target"]) == (
        2.0, 10.0 / 60, 200.0)


def test_runs_without_evals_have_no_default_target(runs):
    got = runs_eval_compare(runs=[runs[2]])
    assert got["target"] is None and got["rows"][0]["reached"] is False


def test_the_apis_answer_for_the_users_runs_only(runs, api, bob_api):
    a, b, _ = runs
    got = api.get(f"/api/runs/{a.id}/evals/?x=step").json()
    assert got["curves"][0]["version"] == [1, 3, 5]
    got = api.get(f"/api/runs/compare/evals/?ids={a.id},{b.id}&target=0.5&x=time").json()
    assert [r["reached"] for r in got["rows"]] == [True, False]
    assert got["series"][str(a.id)]["x"] == [10.0, 30.0, 50.0]
    bad = api.get(f"/api/runs/compare/evals/?ids={a.id}&metric=best")
    assert bad.status_code == 400 and "metric" in str(bad.json())
    assert api.get(f"/api/runs/compare/evals/?ids={a.id}&target=x").status_code == 400
    assert bob_api.get(f"/api/runs/{a.id}/evals/").status_code == 404
    assert bob_api.get(f"/api/runs/compare/evals/?ids={a.id}").status_code == 404
