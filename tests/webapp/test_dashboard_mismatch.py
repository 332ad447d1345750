"""The run page's reward-failure header and the mismatch chart group read the metric names the
trainer produces (declared once in training_core/metrics.py)."""

import pytest

from training_core.algorithms.correction import mismatch_metrics, mismatch_sums
from training_core.metric_names import EVAL_ERRORS, MISMATCH, REWARD_ERROR_FRAC
from webapp.dashboard.charts import RUN_CHART_GROUPS
from webapp.dashboard.formatting import glance_items


def test_the_mismatch_group_charts_exactly_what_the_trainer_produces():
    import torch

    produced = set(mismatch_metrics(mismatch_sums(torch.zeros(1, 2), torch.zeros(1, 2),
                                                  torch.ones(1, 2))))
    groups = {gid: (title, charts) for gid, title, charts in RUN_CHART_GROUPS}
    title, charts = groups["mismatch"]
    charted = {key for _, keys in charts for key in keys}
    assert title == "Rollout–training mismatch"
    assert charted == set(MISMATCH.ALL) == produced
    reward_keys = {key for _, keys in groups["reward"][1] for key in keys}
    assert {REWARD_ERROR_FRAC, EVAL_ERRORS} <= reward_keys


def test_header_marks_failed_rewards_only_when_there_are_some():
    glance = {"step": 2, "total": 4, "first": {},
              "latest": {"reward/mean": 0.5, REWARD_ERROR_FRAC: 0.25, EVAL_ERRORS: 0.0}}
    items = {label: (value, alert) for label, value, _, alert in glance_items(glance)}
    assert items["failed rewards"] == ("25.0%", True)
    assert items["failed eval rows"] == ("0", False)
    assert items["reward"][1] is False


@pytest.mark.django_db
def test_run_page_header_shows_the_reward_error_fraction_in_red(alice, client, run):
    from webapp.tracking.services import metrics_ingest

    metrics_ingest(run=run, points=[{"key": "version", "step": 1, "value": 1},
                                    {"key": REWARD_ERROR_FRAC, "step": 1, "value": 0.5}])
    client.force_login(alice)
    page = client.get(f"/runs/{run.id}/").content.decode()
    header = page[page.index('id="glance"'):page.index('class="metric-groups"')]
    assert '<div class="kpi big alert"><span>failed rewards</span><b>50.0%</b>' in header
    assert "Rollout–training mismatch" in page  # the chart group's section

    metrics_ingest(run=run, points=[{"key": REWARD_ERROR_FRAC, "step": 2, "value": 0.0},
                                    {"key": "version", "step": 2, "value": 2}])
    page = client.get(f"/runs/{run.id}/").content.decode()
    header = page[page.index('id="glance"'):page.index('class="metric-groups"')]
    assert '<div class="kpi big"><span>failed rewards</span><b>0.0%</b>' in header
