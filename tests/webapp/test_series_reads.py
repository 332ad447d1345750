"""One chart read buckets many keys at once, each with its own step range, bucket width and
rollup level (a VALUES row per key joined to the points or blocks): every key's series must be
what its points say, as if it had been read alone. A read big enough to sort on disk runs with
transaction-local PostgreSQL settings, gives the same answer, and leaves nothing set behind."""

from __future__ import annotations

import random

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.webapp.test_rollups import _expected, _stored
from webapp.tracking import selectors
from webapp.tracking.selectors import metric_series_get, run_series
from webapp.tracking.services import metrics_ingest

# key -> its steps: every step, every 10th (an eval), a short late one, one from before step 0,
# and one long enough that coarse buckets read rollup blocks while the others read points.
SHAPES = {
    "reward/mean": range(0, 3000),
    "eval/accuracy": range(0, 3000, 10),
    "late/short": range(2500, 2620),
    "early": range(-7, 400),
    "long": range(0, 40_000, 4),
}


@pytest.fixture
def shaped_run(run):
    rng = random.Random(5)
    for key, steps in SHAPES.items():
        metrics_ingest(run=run, points=[{"key": key, "step": s, "value": rng.uniform(-2, 2),
                                         "time": 1000.0 + s + rng.random()} for s in steps])
    return run


def _same(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    assert got["min"] == want["min"] and got["max"] == want["max"]
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-12)


@pytest.mark.django_db
@pytest.mark.parametrize("buckets", [400, 60, 7])
def test_one_read_of_many_keys_gives_each_key_what_its_points_say(shaped_run, buckets):
    together = run_series(run=shaped_run, keys=list(SHAPES), buckets=buckets)
    assert [s["key"] for s in together] == list(SHAPES)
    for series in together:
        _same(series, _expected(_stored(shaped_run, series["key"]), buckets))
        alone = metric_series_get(run=shaped_run, key=series["key"], buckets=buckets)
        # The database sums a bucket in whatever order its plan reads the rows: the last bit
        # of a mean may differ between two reads, everything else may not.
        assert {**series, "mean": None} == {**alone, "mean": None}
        assert series["mean"] == pytest.approx(alone["mean"], rel=1e-12)


@pytest.mark.django_db
def test_keys_without_points_come_back_empty_among_the_others(shaped_run):
    got = run_series(run=shaped_run, keys=["nothing", "late/short", "nothing/either"], buckets=50)
    assert [s["step"] for s in (got[0], got[2])] == [[], []]
    _same(got[1], _expected(_stored(shaped_run, "late/short"), 50))


def _show(name: str) -> str:
    with connection.cursor() as cur:
        cur.execute(f"SHOW {name}")
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)  # autocommit, as a request runs: no outer transaction
def test_a_big_read_runs_with_its_own_settings_and_leaves_none_behind(shaped_run, monkeypatch):
    keys = ["reward/mean", "eval/accuracy", "early"]
    small = run_series(run=shaped_run, keys=keys, buckets=3000)  # every point: width 1
    before = {name: _show(name) for name in ("work_mem", "jit", "max_parallel_workers_per_gather")}
    monkeypatch.setattr(selectors, "BIG_READ_ROWS", 1000)  # these ~3.7k points count as big
    with CaptureQueriesContext(connection) as q:
        big = run_series(run=shaped_run, keys=keys, buckets=3000)
    assert any("set_config('work_mem'" in x["sql"] for x in q.captured_queries)
    assert [{**s, "mean": None} for s in big] == [{**s, "mean": None} for s in small]
    for b, s in zip(big, small, strict=True):
        assert b["mean"] == pytest.approx(s["mean"], rel=1e-12)
    assert {name: _show(name) for name in before} == before


@pytest.mark.django_db
def test_chart_answers_parse_to_what_the_standard_encoder_gives(shaped_run, api, bob_api):
    """The metrics and comparison APIs encode with orjson: the same JSON values (run ids as
    string keys, floats to the last digit) as DRF's own renderer, still behind the access
    check."""
    import json

    from rest_framework.renderers import JSONRenderer

    keys = ",".join(SHAPES)
    for url, params in ((f"/api/runs/{shaped_run.id}/metrics/", {"keys": keys, "buckets": 300}),
                        ("/api/runs/compare/", {"ids": str(shaped_run.id), "keys": keys,
                                                "buckets": 300, "x": "time"})):
        resp = api.get(url, params)
        assert resp.status_code == 200 and resp["Content-Type"] == "application/json"
        assert json.loads(resp.content) == json.loads(JSONRenderer().render(resp.data))
        assert bob_api.get(url, params).status_code == 404
    assert list(json.loads(resp.content)["series"]) == [str(shaped_run.id)]
    assert api.get("/api/runs/compare/", {"ids": str(shaped_run.id)},
                   HTTP_ACCEPT="application/json; indent=2").content.startswith(b"{\n  ")


def test_an_answer_orjson_cannot_encode_falls_back_to_drfs_encoder():
    """orjson refuses integers beyond 64 bits, which a spec may hold (a seed has no bound):
    such an answer is encoded by DRF's renderer instead of failing the request."""
    import json

    from webapp.core.renderers import FastJSONRenderer

    data = {"seed": 2**70, "text": "a\u2028b", "steps": [1.5, 2]}
    assert json.loads(FastJSONRenderer().render(data, "application/json")) == data
