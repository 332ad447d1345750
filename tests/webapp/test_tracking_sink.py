"""The trainer's HttpSink against the real web app (live server, real database)."""

import pytest

from training_core.ports import free_port
from training_core.tracking_sink import HttpSink
from webapp.runs.models import RunEvent
from webapp.tracking.models import MetricPoint, TrajectorySample

pytestmark = pytest.mark.django_db(transaction=True)


def test_sink_delivers_metrics_events_trajectories_and_status(live_server, run, ingest_token, tmp_path):
    sink = HttpSink(live_server.url, ingest_token, spool_dir=tmp_path / "spool", flush_interval_s=0.1)
    sink.status("running")
    for step in range(1, 4):
        sink.log(step, {"reward/mean": step / 10, "loss": 0.5, "flag": True})
    sink.event("checkpoint", "saved step 3", step=3)
    sink.checkpoint(3, 3, "/runs/x/checkpoints/step3")
    sink.trajectories(3, [{"index": 0, "prompt": "1+1=", "completion": "2", "reward": 1.0,
                           "tokens": ["2"], "token_versions": [2]}])
    sink.close()
    assert sink.pending() == 0
    assert MetricPoint.objects.filter(run=run, key="reward/mean").count() == 3
    assert not MetricPoint.objects.filter(key="flag").exists()  # booleans are not metrics
    assert RunEvent.objects.filter(run=run, kind="checkpoint").count() == 1
    assert TrajectorySample.objects.filter(run=run, step=3).count() == 1
    assert run.checkpoints.get().path == "/runs/x/checkpoints/step3"
    run.refresh_from_db()
    assert run.status == "running"


def test_unreachable_tracker_spools_then_delivers_everything_once(live_server, run, ingest_token,
                                                                 tmp_path):
    spool = tmp_path / "spool"
    down = HttpSink(f"http://127.0.0.1:{free_port()}", ingest_token, spool_dir=spool,
                    flush_interval_s=0.05, close_timeout_s=1.0)
    for step in range(50):
        down.log(step, {"reward/mean": float(step)})
    down.event("note", "while the tracker was down")
    down.close()
    assert down.pending() == 51 and down.failures >= 1
    assert MetricPoint.objects.filter(run=run).count() == 0

    up = HttpSink(live_server.url, ingest_token, spool_dir=spool, flush_interval_s=0.05)
    up.log(50, {"reward/mean": 50.0})
    up.close()
    assert up.pending() == 0
    steps = sorted(MetricPoint.objects.filter(run=run).values_list("step", flat=True))
    assert steps == list(range(51)), "nothing lost"

    # Replaying the whole spool (a retried delivery) duplicates nothing.
    (spool / "delivered.offset").write_text("0")
    again = HttpSink(live_server.url, ingest_token, spool_dir=spool, flush_interval_s=0.05)
    again.close()
    assert MetricPoint.objects.filter(run=run).count() == 51
    assert RunEvent.objects.filter(run=run, kind="note").count() == 1


def test_missing_settings_are_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tracker_url"):
        HttpSink(None, "x", spool_dir=tmp_path)
