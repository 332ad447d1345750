"""Issue 47, item 4: one NaN metric made the tracker refuse the sink's whole batch (up to 2,000
records), silently. Non-finite values now travel as null (skipped by the tracker), and a batch
the tracker refuses is delivered again record by record, so only the bad record is lost."""

from __future__ import annotations

import math

import pytest

from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    dataset_version,
    ingest_token,
    project,
    reward_version,
    run,
)
from training_core.tracking_sink import HttpSink
from webapp.runs.models import RunEvent
from webapp.tracking.models import MetricPoint, TrajectorySample

pytestmark = pytest.mark.django_db(transaction=True)


def test_non_finite_values_go_as_null_and_nothing_else_is_lost(live_server, run, ingest_token,  # noqa: F811
                                                               tmp_path):
    sink = HttpSink(live_server.url, ingest_token, spool_dir=tmp_path / "spool",
                    flush_interval_s=0.05)
    sink.log(1, {"loss": math.nan, "reward/mean": 0.5})
    sink.log(2, {"reward/mean": math.inf, "loss": 0.25})
    sink.event("note", "a NaN in the data", value=math.nan, nested={"x": [1.0, -math.inf]})
    sink.trajectories(1, [{"index": 0, "prompt": "p", "completion": "c", "reward": 0.0,
                           "info": {"w": math.nan}}])
    sink.close()
    assert sink.pending() == 0 and sink.rejected == 0
    stored = set(MetricPoint.objects.filter(run=run).values_list("key", "step"))
    assert stored == {("reward/mean", 1), ("loss", 2)}  # the NaN and the inf are skipped
    event = RunEvent.objects.get(run=run, kind="note")
    assert event.data == {"value": None, "nested": {"x": [1.0, None]}}
    assert TrajectorySample.objects.get(run=run).info == {"w": None}


def test_one_record_the_tracker_refuses_costs_only_itself(live_server, run, ingest_token,  # noqa: F811
                                                          tmp_path):
    sink = HttpSink(live_server.url, ingest_token, spool_dir=tmp_path / "spool",
                    flush_interval_s=5.0)  # everything below goes in one batch
    for step in range(1, 6):
        sink.log(step, {"reward/mean": step / 10})
        sink.event("note", f"step {step}")
    sink.event("k" * 31, "a kind longer than the tracker takes (30)")  # a 400 for its batch
    sink.log(6, {"reward/mean": 0.6})
    sink.close()
    assert sink.pending() == 0 and sink.rejected == 2  # the batch, then the record alone
    assert MetricPoint.objects.filter(run=run, key="reward/mean").count() == 6
    assert RunEvent.objects.filter(run=run, kind="note").count() == 5


def test_a_429_keeps_the_records_for_later(live_server, run, ingest_token, tmp_path,  # noqa: F811
                                           settings):
    """The tracker's per-token rate (429) is waited out: nothing is dropped as refused."""
    settings.INGEST_RATE_PER_S = 0  # every request over the rate
    sink = HttpSink(live_server.url, ingest_token, spool_dir=tmp_path / "spool",
                    flush_interval_s=0.05, close_timeout_s=1.0)
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    assert sink.pending() == 1 and sink.rejected == 0 and sink.failures >= 1
    settings.INGEST_RATE_PER_S = 20
    again = HttpSink(live_server.url, ingest_token, spool_dir=tmp_path / "spool",
                     flush_interval_s=0.05)
    again.close()
    assert again.pending() == 0
    assert MetricPoint.objects.filter(run=run, key="reward/mean").count() == 1
