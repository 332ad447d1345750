"""Chart series read rollup blocks for wide buckets and points for narrow ones: both must give
what the points themselves say, after retried and replaced batches too. X-axes (wall time,
tokens consumed) and the comparison summary are computed from the same data."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from webapp.tracking.models import ROLLUP_LEVELS, ROLLUP_STEPS, MetricPoint, MetricRollup
from webapp.tracking.selectors import metric_series_get, run_series, run_summaries
from webapp.tracking.services import metric_rollups_rebuild, metrics_ingest

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]


def _ingest(run, steps, key="reward/mean", f=lambda s: s / 10, wall=lambda s: 1000.0 + s):
    return metrics_ingest(run=run, points=[{"key": key, "step": s, "value": f(s), "time": wall(s)}
                                           for s in steps])


def _expected(points: list[tuple[int, float, float]], buckets: int) -> dict[str, list]:
    """The bucketing rule, computed here from the points: buckets of ``width`` steps, widened to
    whole rollup blocks when at least one block wide."""
    lo, hi = points[0][0], points[-1][0]
    width = max(1, -(-(hi - lo + 1) // buckets))
    if 1.5 * width >= ROLLUP_STEPS:  # the coarsest level whose blocks fit, with 1.5x slack
        size = max(z for z in ROLLUP_LEVELS if z <= 1.5 * width)
        blocks = -(-width // size)
        bucket_of = lambda s: (s // size - lo // size) // blocks  # noqa: E731
    else:
        bucket_of = lambda s: (s - lo) // width  # noqa: E731
    grouped: dict[int, list[tuple[int, float]]] = {}
    for step, value, _ in points:
        grouped.setdefault(bucket_of(step), []).append((step, value))
    rows = [grouped[b] for b in sorted(grouped)]
    return {"step": [max(s for s, _ in r) for r in rows],
            "mean": [sum(v for _, v in r) / len(r) for r in rows],
            "min": [min(v for _, v in r) for r in rows], "max": [max(v for _, v in r) for r in rows]}


def _stored(run, key="reward/mean"):
    return list(MetricPoint.objects.filter(run=run, key=key).order_by("step")
                .values_list("step", "value", "wall_time"))


@pytest.mark.parametrize("buckets", [500, 60, 20, 7, 1])  # points; levels 0, 1, 2, 3
def test_series_over_rollups_equal_the_points_after_retries_and_replacements(run, buckets):
    rng = random.Random(buckets)
    values = {s: rng.random() for s in range(-5, 3000)}
    for start in range(-5, 3000, 500):
        _ingest(run, range(start, min(start + 500, 3000)), f=values.__getitem__)
    _ingest(run, range(995, 1495), f=values.__getitem__)  # a retried batch: nothing changes
    # A resumed run trains steps 1000-1499 again: new values replace the stored ones.
    assert _ingest(run, range(1000, 1500), f=lambda s: 5 + values[s]) == 500
    points = _stored(run)
    assert len(points) == 3005
    got = metric_series_get(run=run, key="reward/mean", buckets=buckets)
    want = _expected(points, buckets)
    assert got["step"] == want["step"] and got["x"] == want["step"]
    assert got["min"] == want["min"] and got["max"] == want["max"]
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-12)
    assert got["downsampled"] == (len(want["step"]) < len(points))


def test_rollup_blocks_match_the_points_at_every_level_and_rebuild_gives_the_same(run):
    rng = random.Random(3)
    _ingest(run, range(-40, 5000), f=lambda s: rng.random())
    _ingest(run, range(300, 400), f=lambda s: -1.0)  # replaced
    _ingest(run, range(4000, 4001), f=lambda s: 7.0)  # one point, deep in a level-2 block
    points = _stored(run)
    want = {}
    for level, size in enumerate(ROLLUP_LEVELS):
        for step, value, wall in points:
            b = want.setdefault((level, step // size), {"n": 0, "total": 0.0, "low": value,
                                                          "high": value, "first": step, "wall": wall})
            b.update(n=b["n"] + 1, total=b["total"] + value, low=min(b["low"], value),
                     high=max(b["high"], value), last=step, wall=max(b["wall"], wall))

    def stored():
        return {(r.level, r.block): (r.n, round(r.total, 9), r.low, r.high, r.first_step,
                                     r.last_step, r.wall_time)
                for r in MetricRollup.objects.filter(run=run, key="reward/mean")}

    assert stored() == {k: (b["n"], round(b["total"], 9), b["low"], b["high"], b["first"],
                            b["last"], b["wall"]) for k, b in want.items()}
    before = stored()
    MetricRollup.objects.filter(run=run).update(total=0)  # damaged, or loaded around the ingest
    metric_rollups_rebuild(run=run)
    assert stored() == before


@pytest.mark.parametrize("steps", [60, 6000])  # points, then rollup blocks
def test_x_axes_wall_time_and_tokens_consumed(run, steps):
    for key, f in (("version", float), ("tokens/consumed", lambda s: 10.0),
                   ("reward/mean", lambda s: 0.5)):
        _ingest(run, range(1, steps + 1), key=key, f=f, wall=lambda s: 500.0 + 2 * s)
    by_x = {x: run_series(run=run, keys=["reward/mean"], buckets=50, x=x)[0]
            for x in ("step", "time", "tokens")}
    step = by_x["step"]["step"]
    assert by_x["time"]["x"] == [2.0 * (s - 1) for s in step]  # seconds since the first step
    assert by_x["tokens"]["x"] == pytest.approx([10.0 * s for s in step])


def test_summary_answers_which_run_is_better(run, project, alice, dataset_version, reward_version):
    from webapp.runs.services import run_create

    slow = run_create(project=project, user=alice, name="slow", dataset_version=dataset_version,
                      reward_version=reward_version, spec={})
    for r, reward, rate in ((run, lambda s: s / 100, 200.0), (slow, lambda s: 0.25, 100.0)):
        _ingest(r, range(1, 101), key="version", f=float, wall=lambda s: 100.0 + s)
        _ingest(r, range(1, 101), f=reward, wall=lambda s: 100.0 + s)
        _ingest(r, range(1, 101), key="tokens_per_s", f=lambda s, v=rate: v)
        _ingest(r, [0, 50, 100], key="eval/accuracy", f=lambda s, b=reward(100): b * s / 100)
    summary = run_summaries(runs=[run, slow], target=0.5)
    fast_row, slow_row = summary["rows"]
    assert summary["target"] == 0.5
    assert fast_row["final_reward"] == pytest.approx(sum(s / 100 for s in range(91, 101)) / 10)
    assert slow_row["final_reward"] == pytest.approx(0.25)
    assert (fast_row["best_eval"], fast_row["best_eval_step"], fast_row["final_eval"]) == (1.0, 100, 1.0)
    assert fast_row["tokens_per_s"] == pytest.approx(200.0) and fast_row["steps"] == 100
    assert fast_row["wall_s"] == pytest.approx(99.0)
    # The mean of 5 consecutive steps first reaches 0.5 at step 52 (0.48 .. 0.52).
    assert fast_row["step_to_target"] == 52 and fast_row["time_to_target_s"] == pytest.approx(51.0)
    assert slow_row["step_to_target"] is None and slow_row["time_to_target_s"] is None
    # Without a target: 90% of the best final reward.
    assert run_summaries(runs=[run, slow])["target"] == pytest.approx(0.9 * fast_row["final_reward"])


def test_rollups_on_sqlite_the_demos_database(tmp_path):
    """The same statements on SQLite (the embedded default): migrate, ingest, replace, read."""
    script = """
import django, random
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from webapp.accounts.services import project_create, user_create
from webapp.datasets.services import dataset_create_builtin
from webapp.rewards.services import reward_function_create
from webapp.runs.models import Run
from webapp.tracking.models import MetricPoint
from webapp.tracking.selectors import metric_series_get
from webapp.tracking.services import metrics_ingest
user = user_create(username="sq", password="a long passphrase 1")
project = project_create(user=user, name="sq")
dv = dataset_create_builtin(project=project, user=user, name="a", builtin="arithmetic", size=50)
rv = reward_function_create(project=project, user=user, name="r", builtin="arithmetic")
run = Run.objects.create(project=project, name="r", dataset_version=dv, reward_version=rv, spec={})
rng = random.Random(0)
pts = lambda steps, f: [{"key": "k", "step": s, "value": f(s), "time": 1.0 + s} for s in steps]
metrics_ingest(run=run, points=pts(range(-3, 6000), lambda s: rng.random()))
metrics_ingest(run=run, points=pts(range(500, 700), lambda s: 9.0))
points = list(MetricPoint.objects.filter(run=run, key="k").order_by("step").values_list("step", "value"))
lo = points[0][0]
# 6003 steps: each bucket count reads one level (32 .. 8192-step blocks), 400 the points.
for buckets, size in ((1, 8192), (2, 2048), (10, 512), (40, 128), (150, 32), (400, 0)):
    got = metric_series_get(run=run, key="k", buckets=buckets)
    width = -(-6003 // buckets)
    blocks = -(-width // size) if size else width
    groups = {}
    for s, v in points:
        bucket = (s // size - lo // size) // blocks if size else (s - lo) // width
        groups.setdefault(bucket, []).append((s, v))
    want = [groups[g] for g in sorted(groups)]
    assert got["step"] == [max(s for s, _ in g) for g in want], (buckets, got["step"])
    assert got["max"] == [max(v for _, v in g) for g in want]
    assert all(abs(a - sum(v for _, v in g) / len(g)) < 1e-9 for a, g in zip(got["mean"], want))
# Keys of other ranges in one read: each as read alone (points and blocks in one request).
from webapp.tracking.selectors import run_series
metrics_ingest(run=run, points=[{"key": "k2", "step": s, "value": rng.random(), "time": 1.0 + s}
                                for s in range(100, 900, 3)])
for buckets in (1, 10, 150, 400):
    both = run_series(run=run, keys=["k", "k2"], buckets=buckets)
    for got, key in zip(both, ("k", "k2")):
        alone = metric_series_get(run=run, key=key, buckets=buckets)
        assert {**got, "mean": 0} == {**alone, "mean": 0}, (buckets, key)
        assert all(abs(a - b) < 1e-9 for a, b in zip(got["mean"], alone["mean"]))
print("sqlite ok")
"""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "webapp.config.settings.local",
           "OOLONG_DATA_DIR": str(tmp_path), "PYTHONPATH": f"{ROOT}:{ROOT / 'platform'}"}
    env.pop("DATABASE_URL", None)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "sqlite ok" in out.stdout, out.stderr[-3000:]
