"""Server-rendered pages without a browser: forms parse the input (tests/webapp/test_browser.py
drives the same pages in Chromium)."""

import pytest

pytestmark = pytest.mark.django_db


def test_forms_name_the_bad_field_and_refuse_yaml_aliases(alice):
    """Server-rendered forms: a bad value is reported by field, nothing is stored, and a YAML
    alias bomb in the spec box is refused before it expands."""
    from django.test import Client

    from webapp.runs.models import Run

    client = Client()
    client.force_login(alice)
    bad = client.post("/runs/new/", {"project": "x", "dataset_version": "1", "reward_version": "1",
                                     "name": "kept", "spec": "trainer:\n  steps: 3\n"})
    assert bad.status_code == 400 and b"<code>project</code>" in bad.content
    # The form comes back as the user filled it: nothing typed is lost.
    assert b'value="kept"' in bad.content and b"steps: 3" in bad.content
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n"
    resp = client.post("/runs/new/", {"project": "1", "dataset_version": "1", "reward_version": "1",
                                      "spec": bomb})
    assert resp.status_code == 400 and b"aliases" in resp.content and not Run.objects.exists()
    compare = client.get("/compare/", {"id_list": "1,abc"})
    assert compare.status_code == 200 and b"run ids are numbers" in compare.content


def test_metric_values_are_shown_with_units_in_groups():
    from webapp.dashboard.formatting import format_metric, grouped_metrics

    assert format_metric("version", 80.0) == "80"
    assert format_metric("tokens/consumed", 72000.0) == "72,000"
    assert format_metric("time/step_s", 0.2314) == "231 ms"
    assert format_metric("time/eval_wait_s", 12.5) == "12.50 s"
    assert format_metric("tokens_per_s", 3676.4) == "3,676/s"
    assert format_metric("eval/accuracy", 0.935) == "93.5%"
    assert format_metric("rollout/server_busy_frac", 0.5) == "50.0%"
    assert format_metric("reward/mean", 0.123456) == "0.1235"
    groups = grouped_metrics({"time/step_s": 0.2, "reward/mean": 0.5, "loss": 0.1,
                              "eval/accuracy": 0.9, "zzz/custom": 1.0})
    assert [g for g, _ in groups] == ["reward", "eval", "loss", "time", "zzz"]


def test_run_page_shows_grouped_formatted_metrics(alice, client, run):
    from webapp.tracking.services import metrics_ingest

    metrics_ingest(run=run, points=[{"key": "version", "step": 3, "value": 80},
                                    {"key": "time/step_s", "step": 3, "value": 0.25}])
    client.force_login(alice)
    page = client.get(f"/runs/{run.id}/").content.decode()
    assert "<b>80</b>" in page and "<b>250 ms</b>" in page and "80.0000" not in page
    assert "<summary>loss</summary>" in page and "<summary>time</summary>" in page


def test_run_page_header_shows_progress_eta_and_change_since_start(alice, client, run):
    from webapp.tracking.services import metrics_ingest

    # run.spec trainer.steps is 5 (the fixture); three steps done at 2 s a step.
    metrics_ingest(run=run, points=[
        {"key": "reward/mean", "step": 1, "value": 0.25},
        {"key": "reward/mean", "step": 3, "value": 0.5},
        {"key": "eval/accuracy", "step": 0, "value": 0.5},
        {"key": "eval/accuracy", "step": 3, "value": 0.75},
        {"key": "version", "step": 3, "value": 3},
        {"key": "time/step_s", "step": 3, "value": 2.0}])
    client.force_login(alice)
    page = client.get(f"/runs/{run.id}/").content.decode()
    header = page[page.index('id="glance"'):page.index('class="metric-groups"')]
    assert "3 / 5 · ETA 4 s" in header
    assert "<b>0.5</b> <small>+0.250 since start</small>" in header
    assert "<b>75.0%</b> <small>+25.0 pts since start</small>" in header
