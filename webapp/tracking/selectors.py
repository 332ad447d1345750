"""Reads for charts: series are downsampled in the database (min/max/mean per step bucket), so a
100k-step run draws as fast as a 100-step one."""

from __future__ import annotations

import bisect
from typing import Any

from django.db import connection
from django.db.models import Max, Min, Sum

from webapp.runs.models import Run
from webapp.tracking.models import (
    ROLLUP_STEPS,
    Checkpoint,
    LatestMetric,
    MetricPoint,
    MetricRollup,
    TrajectorySample,
)


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


X_AXES = ("step", "time", "tokens")
TOKENS_KEY = "tokens/consumed"


def metric_series_get(*, run: Run, key: str, buckets: int = 500, x: str = "step") -> dict[str, Any]:
    """{"key", "step": [...], "mean", "min", "max", "downsampled": bool, "x": [...]}: one value
    per bucket of steps. ``x`` is the x-axis value of each point: its step, its wall time in
    seconds since the run's first step (``time``), or the tokens consumed up to it
    (``tokens``)."""
    return run_series(run=run, keys=[key], buckets=buckets, x=x)[0]


def run_series(*, run: Run, keys: list[str], buckets: int = 500, x: str = "step") -> list[dict[str, Any]]:
    """Several of a run's series on one x-axis (the axis' mapping is read once)."""
    axis = _XAxis(run, x)
    return [axis.add(_series(run, key, buckets)) for key in keys]


def _series(run: Run, key: str, buckets: int) -> dict[str, Any]:
    """Bucketed in SQL. Buckets of at least ROLLUP_STEPS steps read the rollup blocks (about
    span / ROLLUP_STEPS rows), narrower ones the points (at most buckets * ROLLUP_STEPS rows)."""
    bounds = MetricPoint.objects.filter(run=run, key=key).aggregate(lo=Min("step"), hi=Max("step"))
    lo, hi = bounds["lo"], bounds["hi"]
    if lo is None:
        return {"key": key, "step": [], "mean": [], "min": [], "max": [], "time": [],
                "downsampled": False}
    span = hi - lo + 1
    width = max(1, -(-span // max(buckets, 1)))  # ceil division
    if width >= ROLLUP_STEPS:
        blocks = -(-width // ROLLUP_STEPS)  # rollup blocks per bucket
        sql = (f"SELECT MAX(last_step), SUM(total) / SUM(n), MIN(low), MAX(high), MAX(wall_time) "
               f"FROM {MetricRollup._meta.db_table} WHERE run_id = %s AND key = %s "
               "GROUP BY (block - %s) / %s ORDER BY 1")
        params: list[Any] = [run.id, key, lo // ROLLUP_STEPS, blocks]
    elif width == 1:
        sql = (f"SELECT step, value, value, value, wall_time FROM {MetricPoint._meta.db_table} "
               "WHERE run_id = %s AND key = %s ORDER BY step")
        params = [run.id, key]
    else:
        sql = (f"SELECT MAX(step), AVG(value), MIN(value), MAX(value), MAX(wall_time) "
               f"FROM {MetricPoint._meta.db_table} WHERE run_id = %s AND key = %s "
               "GROUP BY (step - %s) / %s ORDER BY 1")
        params = [run.id, key, lo, width]
    with connection.cursor() as cur:
        cur.execute(sql, params)
        rows = cur.fetchall()
    return {"key": key, "step": [r[0] for r in rows], "mean": [r[1] for r in rows],
            "min": [r[2] for r in rows], "max": [r[3] for r in rows], "time": [r[4] for r in rows],
            "downsampled": width > 1}


class _XAxis:
    """Turns a series' steps (and bucket times) into x values for one run."""

    def __init__(self, run: Run, x: str):
        if x not in X_AXES:
            raise ValueError(f"x must be one of {', '.join(X_AXES)}")
        self.run, self.x = run, x
        self._start: float | None = None
        self._tokens: tuple[list[int], list[float]] | None = None

    def add(self, series: dict[str, Any]) -> dict[str, Any]:
        times = series.pop("time")
        if self.x == "step":
            series["x"] = list(series["step"])
        elif self.x == "time":
            start = self.start(times)
            series["x"] = [t - start for t in times]
        else:
            steps, totals = self.tokens()
            series["x"] = [_interpolate(steps, totals, s) for s in series["step"]]
        return series

    def start(self, fallback: list[float]) -> float:
        """The wall time of the run's first step (its first ``version`` point: every trainer
        logs one), else the series' own first time."""
        if self._start is None:
            first = (MetricPoint.objects.filter(run=self.run, key="version").order_by("step")
                     .values_list("wall_time", flat=True).first())
            self._start = first if first is not None else (min(fallback) if fallback else 0.0)
        return self._start

    def tokens(self) -> tuple[list[int], list[float]]:
        """(step, tokens consumed up to and including it), ascending: from every point for a
        short run, from the rollup blocks (their last steps) for a long one."""
        if self._tokens is None:
            points = MetricPoint.objects.filter(run=self.run, key=TOKENS_KEY)
            if points.count() <= 4 * 1024:
                pairs = list(points.order_by("step").values_list("step", "value"))
            else:
                pairs = list(MetricRollup.objects.filter(run=self.run, key=TOKENS_KEY)
                             .order_by("block").values_list("last_step", "total"))
            steps, totals, total = [], [], 0.0
            for step, value in pairs:
                total += value
                steps.append(step)
                totals.append(total)
            self._tokens = (steps, totals)
        return self._tokens


def _interpolate(xs: list[int], ys: list[float], at: int) -> float:
    """Piecewise linear through (xs, ys), from (xs[0] - 1, 0) before the first point; flat after
    the last."""
    if not xs:
        return 0.0
    i = bisect.bisect_left(xs, at)
    if i < len(xs) and xs[i] == at:
        return ys[i]
    if i == len(xs):
        return ys[-1]
    x0, y0 = (xs[i - 1], ys[i - 1]) if i > 0 else (xs[0] - 1, 0.0)
    return y0 + (ys[i] - y0) * (at - x0) / (xs[i] - x0)


REWARD_KEY, EVAL_KEY, RATE_KEY = "reward/mean", "eval/accuracy", "tokens_per_s"
FINAL_POINTS = 10  # the final reward is the mean of the last this many steps


def run_summaries(*, runs: list[Run], target: float | None = None) -> dict[str, Any]:
    """What a comparison answers at a glance, per run: final reward (mean of the last
    FINAL_POINTS steps), final and best eval accuracy, mean tokens/s, steps and wall time, and
    the time (and step) the reward first reached ``target`` (smoothed over 5 points; default:
    90% of the best final reward among the runs). ``{"target": ..., "rows": [...]}``."""
    rows, curves = [], {}
    for run in runs:
        axis = _XAxis(run, "time")
        reward = axis.add(_series(run, REWARD_KEY, 300))
        curves[run.id] = reward
        tail = list(MetricPoint.objects.filter(run=run, key=REWARD_KEY).order_by("-step")
                    .values_list("value", flat=True)[:FINAL_POINTS])
        evals = MetricPoint.objects.filter(run=run, key=EVAL_KEY)
        best = evals.order_by("-value", "step").values_list("value", "step").first()
        last = evals.order_by("-step").values_list("value", flat=True).first()
        rate = MetricRollup.objects.filter(run=run, key=RATE_KEY).aggregate(
            total=Sum("total"), n=Sum("n"))
        version = MetricPoint.objects.filter(run=run, key="version").order_by("-step").values_list(
            "step", "wall_time").first()
        rows.append({
            "run_id": run.id, "name": run.name, "status": run.status,
            "steps": version[0] if version else None,
            "wall_s": version[1] - axis.start([]) if version else None,
            "final_reward": sum(tail) / len(tail) if tail else None,
            "final_eval": last, "best_eval": best[0] if best else None,
            "best_eval_step": best[1] if best else None,
            "tokens_per_s": rate["total"] / rate["n"] if rate["n"] else None,
        })
    finals = [r["final_reward"] for r in rows if r["final_reward"] is not None]
    if target is None and finals:
        target = 0.9 * max(finals)
    for row in rows:
        row["time_to_target_s"], row["step_to_target"] = _first_reach(curves[row["run_id"]], target)
    return {"target": target, "rows": rows}


def _first_reach(series: dict[str, Any], target: float | None) -> tuple[float | None, int | None]:
    if target is None:
        return None, None
    means, window = series["mean"], 5
    for i in range(len(means)):
        recent = means[max(0, i - window + 1): i + 1]
        if len(recent) == min(window, len(means)) and sum(recent) / len(recent) >= target:
            return series["x"][i], series["step"][i]
    return None, None


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
