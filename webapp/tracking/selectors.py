"""Reads for charts: series are downsampled in the database (min/max/mean per step bucket), so a
100k-step run draws as fast as a 100-step one."""

from __future__ import annotations

from typing import Any

from django.db import connection
from django.db.models import Max, Min

from webapp.runs.models import Run
from webapp.tracking.models import Checkpoint, LatestMetric, MetricPoint, TrajectorySample


def latest_metrics(*, run: Run) -> dict[str, float]:
    return dict(LatestMetric.objects.filter(run=run).values_list("key", "value"))


def run_last_step(*, run: Run) -> int | None:
    """The last step the trainer reported (the step of its ``version`` metric)."""
    return LatestMetric.objects.filter(run=run, key="version").values_list("step", flat=True).first()


def run_glance(*, run: Run, latest: dict[str, float]) -> dict[str, Any]:
    """What the run page's header shows: progress, the run's latest metrics (``latest``, from
    :func:`latest_metrics`) and, for reward and eval accuracy, their first value (the change
    since the start)."""
    first = {}
    for key in ("reward/mean", "eval/accuracy"):
        value = (MetricPoint.objects.filter(run=run, key=key).order_by("step")
                 .values_list("value", flat=True).first())
        if value is not None:
            first[key] = value
    total = (run.spec or {}).get("trainer", {}).get("steps")
    return {"step": run_last_step(run=run), "total": total, "latest": latest, "first": first}


def latest_metrics_for_runs(*, runs: list[Run], keys: list[str]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {r.id: {} for r in runs}
    for run_id, key, value in LatestMetric.objects.filter(run__in=runs, key__in=keys).values_list(
            "run_id", "key", "value"):
        out[run_id][key] = value
    return out


def metric_series_get(*, run: Run, key: str, buckets: int = 500) -> dict[str, Any]:
    """{"step": [...], "mean": [...], "min": [...], "max": [...], "downsampled": bool}."""
    bounds = MetricPoint.objects.filter(run=run, key=key).aggregate(lo=Min("step"), hi=Max("step"))
    lo, hi = bounds["lo"], bounds["hi"]
    if lo is None:
        return {"key": key, "step": [], "mean": [], "min": [], "max": [], "downsampled": False}
    span = hi - lo + 1
    width = max(1, -(-span // max(buckets, 1)))  # ceil division
    table = MetricPoint._meta.db_table
    if width == 1:
        sql = (f"SELECT step, value, value, value FROM {table} WHERE run_id = %s AND key = %s "
               "ORDER BY step")
        params: list[Any] = [run.id, key]
    else:
        sql = (f"SELECT MAX(step), AVG(value), MIN(value), MAX(value) FROM {table} "
               "WHERE run_id = %s AND key = %s GROUP BY (step - %s) / %s ORDER BY 1")
        params = [run.id, key, lo, width]
    with connection.cursor() as cur:
        cur.execute(sql, params)
        rows = cur.fetchall()
    return {"key": key, "step": [r[0] for r in rows], "mean": [r[1] for r in rows],
            "min": [r[2] for r in rows], "max": [r[3] for r in rows], "downsampled": width > 1}


def metric_series_naive(*, run: Run, key: str) -> dict[str, list]:
    """Every point (the baseline the benchmark compares the downsampled query against)."""
    rows = list(MetricPoint.objects.filter(run=run, key=key).order_by("step").values_list("step", "value"))
    return {"step": [r[0] for r in rows], "value": [r[1] for r in rows]}


def trajectory_list(*, run: Run, step: int | None = None, limit: int = 50) -> list[TrajectorySample]:
    qs = TrajectorySample.objects.filter(run=run)
    if step is not None:
        qs = qs.filter(step=step)
    else:
        last = qs.aggregate(s=Max("step"))["s"]
        qs = qs.filter(step=last) if last is not None else qs.none()
    return list(qs.order_by("index")[:limit])


def trajectory_steps(*, run: Run) -> list[int]:
    return list(TrajectorySample.objects.filter(run=run).values_list("step", flat=True)
                .distinct().order_by("-step")[:200])


def checkpoint_list(*, run: Run, limit: int = 20) -> list[Checkpoint]:
    """The run's newest checkpoints first."""
    return list(run.checkpoints.order_by("-step")[:limit])
