"""The practitioner's dashboard in Chromium, as a new user goes through it: the run form
generated from the spec schema (inline errors, the YAML view in sync both ways, clone), the run
page's chart controls, and a staleness sweep compared on one page. The Celery broker has no
consumer here, so runs stay queued: metrics are written through the tracker's own ingest service,
as a trainer's would arrive, while the page watches. Screenshots land in test-artifacts/."""

from __future__ import annotations

import pytest

from tests.webapp.conftest import QA_ROWS, jsonl
from tests.webapp.test_browser import ARTIFACTS, CHROMIUM, _login, browser_page  # noqa: F401

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not __import__("pathlib").Path(CHROMIUM).exists(),
                       reason="Debian chromium is not installed"),
]


@pytest.fixture
def page():
    yield from browser_page(bypass_csp=True)


@pytest.fixture
def dataset(project, alice):
    from webapp.datasets.services import dataset_upload

    return dataset_upload(project=project, user=alice, name="adds", task="arithmetic",
                          filename="adds.jsonl", data=jsonl(QA_ROWS))


def _series(run, steps: int, reward, *, seconds_per_step: float = 1.0) -> None:
    from webapp.tracking.services import metrics_ingest

    points = []
    for s in range(1, steps + 1):
        for key, value in (("version", s), ("reward/mean", reward(s)), ("tokens/consumed", 100),
                           ("tokens_per_s", 100 / seconds_per_step), ("staleness/mean", 0.5),
                           ("loss", 1.0 / s), ("time/step_s", seconds_per_step)):
            points.append({"key": key, "step": s, "value": value, "time": 1e9 + s * seconds_per_step})
    metrics_ingest(run=run, points=points)


def _field(page, path: str):
    return page.locator(f".field[data-path='{path}']")


def test_a_new_user_creates_a_run_from_the_form_and_watches_it(page, live_server, alice, project,
                                                               dataset, reward_version):
    base = live_server.url
    _login(page, base)
    page.goto(base + "/runs/new/")
    # The common knobs are up front, with their defaults and help.
    common = page.locator("#fields-common")
    for path in ("model.path", "algorithm.preset", "trainer.steps", "trainer.batch_groups",
                 "rollout.group_size", "rollout.max_staleness", "rollout.max_new_tokens",
                 "trainer.lr"):
        assert common.locator(f".field[data-path='{path}']").count() == 1, path
    eta = _field(page, "rollout.max_staleness")
    assert "default 1" in eta.inner_text() and "synchronous" in eta.inner_text()
    # Every other field is in a collapsed section; members never see infrastructure fields.
    assert page.locator("details.section[data-section='trainer'] .field[data-path='trainer.zero_stage']").count() == 1
    assert page.locator(".field[data-path='orchestration.provider']").count() == 0

    page.fill("input[name=name]", "first-run")
    page.fill("#field-trainer-steps", "30")
    page.select_option("#field-algorithm-preset", "dapo")
    # A bad value: the error shows next to the field as it is typed, with run_create's message.
    page.fill("#field-rollout-max-staleness", "-1")
    error = eta.locator(".field-error")
    page.wait_for_function("document.querySelector(\".field[data-path='rollout.max_staleness'] "
                           ".field-error\").textContent.includes('greater than or equal to 0')")
    assert "spec.rollout.max_staleness" not in error.inner_text()
    assert "problem" in page.locator("#spec-status").inner_text()
    page.screenshot(path=str(ARTIFACTS / "run-form-inline-error.png"), full_page=True)
    # Fixed: the error goes, and the YAML view follows the form.
    page.fill("#field-rollout-max-staleness", "2")
    page.wait_for_function("document.querySelector('#spec-status').textContent === 'spec is valid'")
    text = page.input_value("#spec-yaml")
    assert "max_staleness: 2" in text and "steps: 30" in text and "preset: dapo" in text
    assert error.inner_text() == ""
    # And the form follows the YAML view.
    page.fill("#spec-yaml", text.replace("steps: 30", "steps: 12"))
    page.wait_for_function("document.querySelector('#field-trainer-steps').value === '12'")
    page.screenshot(path=str(ARTIFACTS / "run-form.png"), full_page=True)
    page.click("#create-button")
    page.wait_for_url("**/runs/*/")

    from webapp.runs.models import Run

    run = Run.objects.get(name="first-run")
    assert (run.spec["trainer"]["steps"], run.spec["rollout"]["max_staleness"],
            run.spec["algorithm"]["preset"]) == (12, 2, "dapo")
    # The run goes live: metrics arrive while the page is open.
    page.wait_for_selector("#charts-reward .main-svg")
    _series(run, 12, lambda s: s / 12)
    page.wait_for_function("document.getElementById('chart-reward-0').data.some(t => t.name === 'reward/mean')",
                           timeout=20_000)
    # Chart controls: wall time on the x-axis, smoothing, and a group hidden.
    page.select_option("#x-axis", "time")
    page.wait_for_function("document.getElementById('chart-reward-0').layout.xaxis.title.text === 'wall time (s)'")
    xs = page.evaluate("document.getElementById('chart-reward-0').data.find(t => t.name === 'reward/mean').x")
    assert xs[0] == 0 and xs[-1] == pytest.approx(11.0)
    page.fill("#smoothing", "0.6")
    page.dispatch_event("#smoothing", "input")
    page.wait_for_function("document.getElementById('chart-reward-0').data.length >= 2")
    page.uncheck("#chart-controls input[data-group='loss']")
    assert page.locator(".chart-group[data-group='loss']").is_hidden()
    # The choices are remembered on the next visit.
    page.reload()
    page.wait_for_selector("#charts-reward .main-svg")
    assert page.locator(".chart-group[data-group='loss']").is_hidden()
    assert page.input_value("#x-axis") == "time"
    page.click("#raw-metrics summary")
    assert "tokens/consumed" in page.locator("#raw-metrics table").inner_text()
    page.screenshot(path=str(ARTIFACTS / "run-page-controls.png"), full_page=True)

    # Clone: the form starts from this run's configuration.
    page.click("#clone-run")
    page.wait_for_url("**/runs/new/?clone=*")
    page.wait_for_function("document.querySelector('#field-trainer-steps').value === '12'")
    assert page.input_value("input[name=name]") == "first-run (clone)"
    assert page.input_value("#field-rollout-max-staleness") == "2"


def test_an_edit_is_kept_when_the_pages_first_check_answers_after_it(page, live_server, alice,
                                                                     project):
    """The page checks the YAML it came with as it opens; a user who picks a preset before that
    answer arrives keeps the preset (an answer to an older state must not put it back)."""
    base = live_server.url
    _login(page, base)
    held = []
    page.route("**/api/runs/spec-check/",
               lambda route: held.append(route) if not held else route.continue_())
    page.goto(base + "/runs/new/")
    while not held:  # the first check has gone out and waits here
        page.wait_for_timeout(20)
    page.select_option("#field-algorithm-preset", "dapo")
    held[0].continue_()  # answered before the edit's own check (250 ms later) goes out
    page.wait_for_function("document.querySelector('#spec-status').textContent === 'spec is valid'")
    page.fill("#field-trainer-steps", "30")  # the next edit sends the form's whole state
    page.wait_for_function("document.querySelector('#spec-yaml').value.includes('steps: 30')")
    assert "preset: dapo" in page.input_value("#spec-yaml")
    assert page.input_value("#field-algorithm-preset") == "dapo"


def test_a_staleness_sweep_from_the_form_compares_three_runs(page, live_server, alice, project,
                                                             dataset, reward_version):
    base = live_server.url
    _login(page, base)
    page.goto(base + "/runs/new/")
    page.fill("input[name=name]", "eta")
    page.fill("#field-trainer-steps", "40")
    page.click("#sweep summary")
    page.select_option("select[name=sweep_field_1]", "rollout.max_staleness")
    page.fill("input[name=sweep_values_1]", "0, 1, -2")
    assert page.inner_text("#create-button") == "Create sweep (3 runs)"
    page.click("#create-button")
    # A bad value is named, nothing is stored, and the form keeps what was typed.
    page.wait_for_selector(".axis[data-axis='0'] .field-error:not(:empty)")
    assert "axes[0].values[2]" in page.locator(".error-box").inner_text()
    assert page.input_value("input[name=sweep_values_1]") == "0, 1, -2"
    from webapp.runs.models import Run

    assert not Run.objects.exists()
    page.fill("input[name=sweep_values_1]", "0, 1, 2")
    page.click("#create-button")
    page.wait_for_url("**/sweeps/*/")

    runs = list(Run.objects.order_by("id"))
    assert [r.spec["rollout"]["max_staleness"] for r in runs] == [0, 1, 2]
    assert all(r.spec["trainer"]["steps"] == 40 for r in runs)
    for i, run in enumerate(runs):  # more staleness, faster steps, the same learning per step
        _series(run, 40, lambda s: min(1.0, s / 30), seconds_per_step=1.0 / (1 + i))
    page.reload()
    page.wait_for_function("document.getElementById('chart-0') && "
                           "document.getElementById('chart-0').data.length === 3")
    names = page.evaluate("document.getElementById('chart-0').data.map(t => t.name)")
    assert names == [r.name for r in runs]
    # The config diff shows only the field the sweep varies.
    assert [row.split("\t")[0].strip() for row in page.locator("tr.differs").all_inner_texts()] == [
        "rollout.max_staleness"]
    rows = page.locator("#summary tbody tr")
    assert rows.count() == 3
    # The fastest run reaches the target first: bold in the summary.
    assert "best" in (rows.nth(2).locator("td").nth(7).get_attribute("class") or "")
    page.wait_for_selector("#parcoords .parcoords")
    page.screenshot(path=str(ARTIFACTS / "sweep-compare.png"), full_page=True)

    # One run against its sweep, from the compare page.
    page.goto(f"{base}/compare/?ids={runs[1].id}")
    page.wait_for_function("document.getElementById('chart-0') && "
                           "document.getElementById('chart-0').data.length === 3")
    assert page.locator("#summary tr.focus").count() == 1
    page.goto(f"{base}/sweeps/")
    assert "eta" in page.locator("table.runs").inner_text()


def test_compare_with_synchronous_from_a_run_page(page, live_server, alice, project, dataset,
                                                  reward_version):
    from webapp.runs.models import Run
    from webapp.runs.services import run_create

    run = run_create(project=project, user=alice, name="async", dataset_version=dataset,
                     reward_version=reward_version, spec={"rollout": {"max_staleness": 3}})
    _login(page, live_server.url)
    page.goto(f"{live_server.url}/runs/{run.id}/")
    page.click("#compare-sync")
    page.wait_for_url("**/sweeps/*/")
    twins = Run.objects.exclude(id=run.id).order_by("id")
    assert [r.spec["rollout"]["max_staleness"] for r in twins] == [3, 0]
    assert "rollout.max_staleness" in page.locator("#sweep-runs").inner_text()


def _evals(run, values: dict[int, float], *, metric: str = "greedy_accuracy",
           half_width: float = 0.08) -> None:
    """Evaluations as the trainer logs them: eval/<set>/<metric> with its 95% interval and the
    weight version evaluated, at the step's wall time (as _series: 1 s per step)."""
    from webapp.tracking.services import metrics_ingest

    points = []
    for s, v in values.items():
        for key, value in ((metric, v), (f"{metric}_ci_lo", v - half_width),
                           (f"{metric}_ci_hi", v + half_width), ("version", s - 1)):
            points.append({"key": f"eval/heldout/{key}", "step": s, "value": value,
                           "time": 1e9 + s})
    metrics_ingest(run=run, points=points)


def test_the_eval_panel_and_the_time_to_a_target_accuracy(page, live_server, alice, project,
                                                          dataset, reward_version):
    from webapp.runs.services import run_create

    fast, slow = (run_create(project=project, user=alice, name=name, dataset_version=dataset,
                             reward_version=reward_version, spec={"trainer": {"steps": 20}})
                  for name in ("async", "sync"))
    base = live_server.url
    _login(page, base)
    # No evaluation yet: the panel says so.
    page.goto(f"{base}/runs/{fast.id}/")
    assert page.locator("#eval-empty").is_visible()
    for run in (fast, slow):
        _series(run, 20, lambda s: s / 20)
    _evals(fast, {5: 0.2, 10: 0.4, 15: 0.6, 20: 0.7})
    _evals(fast, {5: 0.5, 10: 0.7, 15: 0.8, 20: 0.9}, metric="pass@k")
    _evals(slow, {5: 0.1, 10: 0.2, 15: 0.3, 20: 0.45})
    page.reload()
    chart = "document.getElementById('eval-heldout-greedy_accuracy')"
    page.wait_for_function(f"{chart} && {chart}.data && {chart}.data.length === 3")
    assert page.locator("#eval-empty").is_hidden()
    traces = page.evaluate(f"{chart}.data.map(t => [t.meta, t.fill || '', t.y])")
    # The band: the interval's high end, then its low end filled up to it, under the values.
    assert [t[0] for t in traces] == ["band", "band", "value"] and traces[1][1] == "tonexty"
    assert traces[2][2] == [0.2, 0.4, 0.6, 0.7]
    assert traces[1][2] == pytest.approx([0.12, 0.32, 0.52, 0.62])
    hover = page.evaluate(f"{chart}.data[2].text")
    assert hover[1].startswith("step 10 · version v9 · 95% [0.320, 0.480]")
    assert page.locator("#eval-heldout-pass_k").count() == 1  # each metric the run logged
    page.locator("#eval-panel").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "run-eval-panel.png"), full_page=True)

    # The comparison: both curves with their bands, and the time each first reached the target
    # (default: the lowest final accuracy, 0.45: the fast run between steps 10 and 15).
    page.goto(f"{base}/compare/?ids={fast.id},{slow.id}")
    page.wait_for_function("document.getElementById('eval-compare-chart').data && "
                           "document.getElementById('eval-compare-chart').data.length === 6")
    page.wait_for_function("!document.querySelector('#eval-summary tbody').textContent.includes('loading')")
    assert page.inner_text("#eval-target-label") == "45.0%"
    rows = page.locator("#eval-summary tbody tr")
    first = rows.nth(0).inner_text()
    # 0.45 is a quarter of the way from 0.4 (step 10, 9 s) to 0.6 (step 15, 14 s): 10.25 s.
    assert "async" in first and f"{10.25 / 60:.2f} min" in first and "11.3" in first
    assert "0.17 min" in first and "20.0" in rows.nth(1).inner_text()
    page.fill("#eval-target", "0.65")
    page.dispatch_event("#eval-target", "change")
    page.wait_for_function("document.querySelector('#eval-summary tbody').textContent.includes('not reached')")
    assert "not reached" in rows.nth(1).inner_text() and "min" in rows.nth(0).inner_text()
    page.select_option("#x-axis", "time")
    page.wait_for_function("document.getElementById('eval-compare-chart').layout.xaxis.title.text === 'wall time (s)'")
    page.locator("#eval-summary").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "compare-eval-target.png"), full_page=True)
