"""What the web app reads is what a run writes: every metric a chart, the run header, the run list,
the compare view or the CLI names is declared in training_core.metric_names (the end-to-end
training test checks that a run writes only declared names)."""

from __future__ import annotations

import pytest

from training_core import metric_names as M

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def _named_by_the_web_app() -> dict[str, set[str]]:
    from webapp.dashboard import charts, formatting, views
    from webapp.tracking import selectors

    return {
        "run chart groups": {k for _, _, group in charts.RUN_CHART_GROUPS
                             for _, keys in group for k in keys},
        "compare charts": {k for _, keys in charts.COMPARE_CHARTS for k in keys},
        "run header": {k for k, _ in formatting.GLANCE} | formatting.ALERT_KEYS,
        "metric tile groups": set(formatting.LOSS_KEYS),
        "run list": set(views.LIST_KEYS),
        "compare summary": {selectors.REWARD_KEY, selectors.EVAL_KEY, selectors.RATE_KEY},
    }


@pytest.mark.parametrize("reader", sorted(_named_by_the_web_app()))
def test_every_metric_the_web_app_reads_is_declared(reader):
    undeclared = _named_by_the_web_app()[reader] - M.DECLARED
    assert not undeclared, f"{reader} names metrics nothing declares: {sorted(undeclared)}"


def test_the_cli_compares_declared_metrics():
    import argparse

    from training_core.runs_cli import add_runs_parser

    parser = argparse.ArgumentParser()
    add_runs_parser(parser.add_subparsers())
    args = parser.parse_args(["runs", "compare", "1"])
    assert set(args.keys) <= M.DECLARED


def test_a_chart_naming_an_undeclared_metric_is_caught():
    # The check itself: a typo in a chart is not declared.
    assert "reward/men" not in M.DECLARED and M.REWARD_MEAN in M.DECLARED


def test_timers_are_declared_and_an_undeclared_one_is_refused():
    assert all(M.timer(t) in M.DECLARED for t in M.TIMERS)
    with pytest.raises(KeyError, match="not declared"):
        M.timer("coffee_break")
