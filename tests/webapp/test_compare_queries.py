"""The comparison reads every run's last rewards and first step's time in one statement
(benchmarks/web_load.py: round trips are what a busy database makes slow), with the same answer
as the per-run reads of run_summaries and run_series."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from webapp.tracking.selectors import run_series, run_summaries, runs_compare
from webapp.tracking.services import metrics_ingest

pytestmark = pytest.mark.django_db


def _ingest(run, steps, key, f, wall=lambda s: 1000.0 + s):
    metrics_ingest(run=run, points=[{"key": key, "step": s, "value": f(s), "time": wall(s)}
                                    for s in steps])


@pytest.fixture
def runs(run, project, alice, dataset_version, reward_version):
    from webapp.runs.services import run_create

    more = [run_create(project=project, user=alice, name=f"r{i}", dataset_version=dataset_version,
                       reward_version=reward_version, spec={}) for i in range(2)]
    out = [run, *more]
    for i, r in enumerate(out):
        start = 100.0 * (i + 1)
        if i < 2:  # the last has no version point: its start is its series' first time
            _ingest(r, range(3, 60 + 10 * i), "version", float, wall=lambda s, b=start: b + 2 * s)
        _ingest(r, range(3, 60 + 10 * i), "reward/mean", lambda s, k=i: (s % 7) / 10 + k / 100,
                wall=lambda s, b=start: b + 2 * s)
    return out


@pytest.mark.parametrize("x", ["step", "time"])
def test_the_comparison_answers_as_the_per_run_reads_do(runs, x):
    # 300 buckets: run_summaries' own reward curve (which its time to target reads) has as many.
    got = runs_compare(runs=runs, keys=["reward/mean"], buckets=300, x=x, target=0.3)
    assert got["summary"] == run_summaries(runs=runs, target=0.3)
    for r in runs:
        assert got["series"][r.id] == run_series(run=r, keys=["reward/mean"], buckets=300, x=x)
    rows = {row["run_id"]: row for row in got["summary"]["rows"]}
    # Spot values that could go wrong: the mean of the last 10 rewards, and the time axis start.
    last = [(s % 7) / 10 + 2 / 100 for s in range(79 - 9, 80)]
    assert rows[runs[2].id]["final_reward"] == pytest.approx(sum(last) / 10)
    assert rows[runs[0].id]["wall_s"] == pytest.approx(2 * (59 - 3))


def test_each_more_run_costs_only_its_series_reads(runs):
    def count(rs):
        with CaptureQueriesContext(connection) as q:
            runs_compare(runs=rs, keys=["reward/mean", "loss"], buckets=20, x="time")
        return len(q.captured_queries)

    one, three = count(runs[:1]), count(runs)
    # Two per run for its series (key ranges, then the buckets); the last rewards and the first
    # step's time of every run come in one statement, whatever the number of runs.
    assert three - one == 2 * 2


@pytest.fixture
def shared_series(settings):
    """The production setting: chart reads shared through the cache for a few seconds."""
    from django.core.cache import cache

    settings.SERIES_CACHE_S = 60
    cache.clear()
    yield settings
    cache.clear()


def _reads(fn) -> int:
    with CaptureQueriesContext(connection) as q:
        fn()
    return len(q.captured_queries)


def test_viewers_of_the_same_runs_share_one_read_for_the_cache_interval(runs, shared_series):
    """A second viewer inside the interval costs the database no series read, and sees what the
    first saw; other buckets, keys or runs are entries of their own; after the interval the
    new points show."""
    compare = lambda: runs_compare(runs=runs, keys=["reward/mean"], buckets=50, x="step")  # noqa: E731
    first_cost, first = _reads(compare), compare()
    again_cost = _reads(compare)
    assert again_cost == first_cost - 2 * len(runs)  # no key ranges, no buckets: from the cache
    _ingest(runs[0], range(200, 260), "reward/mean", lambda s: 1.0)
    assert compare()["series"] == first["series"]  # inside the interval: the shared read
    other = runs_compare(runs=runs, keys=["reward/mean"], buckets=51, x="step")
    assert other["series"][runs[0].id][0]["step"][-1] == 259  # other buckets: read afresh
    shared_series.SERIES_CACHE_S = 0.2  # entries written now expire quickly
    from django.core.cache import cache

    cache.clear()
    compare()
    import time

    time.sleep(0.3)
    _ingest(runs[0], range(260, 280), "reward/mean", lambda s: 1.0)
    assert compare()["series"][runs[0].id][0]["step"][-1] == 279  # after the interval: fresh


def test_the_shared_read_is_reached_only_through_the_users_own_access(runs, shared_series, api,
                                                                      bob_api):
    """Alice's comparison fills the cache; Bob, who is not in her project, still gets a 404
    for the same runs: the cache sits behind the access check, keyed by run id."""
    ids = ",".join(str(r.id) for r in runs)
    assert api.get("/api/runs/compare/", {"ids": ids, "keys": "reward/mean"}).status_code == 200
    assert bob_api.get("/api/runs/compare/", {"ids": ids, "keys": "reward/mean"}).status_code == 404
    assert bob_api.get(f"/api/runs/{runs[0].id}/metrics/",
                       {"keys": "reward/mean"}).status_code == 404


def test_a_comparison_reads_only_the_runs_the_cache_lacks(runs, shared_series):
    """The runs' entries come from the cache together; a run not in it is read (its two
    statements) and stored, and the answer is the one every run read afresh gives."""
    compare = lambda rs: runs_compare(runs=rs, keys=["reward/mean"], buckets=40, x="time")  # noqa: E731
    compare(runs[:1])  # the first run's entry is in the cache now
    assert _reads(lambda: compare(runs)) == _reads(lambda: compare(runs)) + 2 * (len(runs) - 1)
    warm = compare(runs)
    shared_series.SERIES_CACHE_S = 0
    assert compare(runs) == warm
