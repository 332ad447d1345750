"""Issue 47, item 9: a run token stored 42 MB of trajectories in 2.4 s, with no bound per run
and no rate. Each run now stores at most so many samples (and bytes of them), metric keys and
events through ingest (what does not fit is dropped, and one ``ingest_limit`` event says so), and
each run token has a request rate (a 429 with Retry-After, which the trainer's sink waits out)."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    dataset_version,
    ingest_token,
    project,
    reward_version,
    run,
)
from webapp.runs.models import RunEvent
from webapp.tracking.models import LatestMetric, TrajectorySample

pytestmark = pytest.mark.django_db


@pytest.fixture
def trainer(ingest_token):  # noqa: F811
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {ingest_token}")
    return c


def _samples(step: int, n: int, text: str = "x") -> list[dict]:
    return [{"step": step, "index": i, "prompt": text, "completion": text, "reward": 0.0}
            for i in range(n)]


def _limit_events(run) -> list[str]:  # noqa: F811
    return list(RunEvent.objects.filter(run=run, kind="ingest_limit").values_list("message", flat=True))


def test_a_run_stores_so_many_samples_and_says_when_it_stops(trainer, run, settings):  # noqa: F811
    settings.INGEST_MAX_TRAJECTORIES = 25
    for step in range(3):
        r = trainer.post("/api/ingest/trajectories/", {"samples": _samples(step, 10)}, format="json")
        assert r.status_code == 200, r.content
    assert r.json() == {"stored": 5}
    assert TrajectorySample.objects.filter(run=run).count() == 25
    # A retried batch inserts nothing and counts nothing.
    trainer.post("/api/ingest/trajectories/", {"samples": _samples(0, 10)}, format="json")
    assert TrajectorySample.objects.filter(run=run).count() == 25
    (message,) = _limit_events(run)
    assert "25 samples" in message and "OOLONG_INGEST_MAX_TRAJECTORIES" in message


def test_a_run_stores_so_many_bytes_of_samples(trainer, run, settings):  # noqa: F811
    settings.INGEST_MAX_TRAJECTORY_BYTES = 200_000
    for step in range(5):  # 5 x 10 samples of ~20 kB: 1 MB asked, 200 kB kept
        trainer.post("/api/ingest/trajectories/", {"samples": _samples(step, 10, "y" * 10_000)},
                     format="json")
    stored = TrajectorySample.objects.filter(run=run).count()
    assert 5 <= stored <= 10, stored
    assert len(_limit_events(run)) == 1


def test_a_run_has_so_many_metric_keys(trainer, run, settings):  # noqa: F811
    settings.INGEST_MAX_METRIC_KEYS = 5
    points = [{"key": f"k{i}", "step": 1, "value": 1.0} for i in range(8)]
    r = trainer.post("/api/ingest/metrics/", {"points": points}, format="json")
    assert r.status_code == 200, r.content
    assert LatestMetric.objects.filter(run=run).count() == 5
    # Known keys still take new steps; new keys do not.
    r = trainer.post("/api/ingest/metrics/", {"points": [{"key": "k0", "step": 2, "value": 2.0},
                                                         {"key": "new", "step": 2, "value": 2.0}]},
                     format="json")
    assert r.json()["inserted"] == 1
    assert set(LatestMetric.objects.filter(run=run).values_list("key", flat=True)) == \
        {f"k{i}" for i in range(5)}
    assert len(_limit_events(run)) == 1


def test_a_run_stores_so_many_events(trainer, run, settings):  # noqa: F811
    settings.INGEST_MAX_EVENTS = 7
    events = [{"kind": "note", "message": str(i)} for i in range(5)]
    assert trainer.post("/api/ingest/events/", {"events": events}, format="json").json() == {"stored": 5}
    assert trainer.post("/api/ingest/events/", {"events": events}, format="json").json() == {"stored": 2}
    assert RunEvent.objects.filter(run=run, kind="note").count() == 7
    assert len(_limit_events(run)) == 1


def test_a_run_token_has_a_request_rate(trainer, run, settings):  # noqa: F811
    from django.core.cache import cache

    cache.clear()
    settings.INGEST_RATE_PER_S = 0.5  # 5 requests per 10 s window
    answers = [trainer.post("/api/ingest/events/", {"events": []}, format="json")
               for _ in range(8)]
    codes = [a.status_code for a in answers]
    assert codes[:5] == [200] * 5 and 429 in codes[5:], codes
    refused = next(a for a in answers if a.status_code == 429)
    assert 0 < int(refused["Retry-After"]) <= 10
    # Another run's token is counted on its own.
    from webapp.runs.services import run_token_issue

    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {run_token_issue(run=run, purpose='test')}")
    assert other.post("/api/ingest/events/", {"events": []}, format="json").status_code == 200
