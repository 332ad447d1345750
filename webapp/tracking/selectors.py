"""Reads for charts: series are downsampled in the database (min/max/mean per step bucket), so a
100k-step run draws as fast as a 100-step one."""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import json
import operator
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.db.models import Max, Sum

from training_core import metric_names as M
from webapp.runs.models import Run
from webapp.runs.selectors import run_spec_resolved
from webapp.tracking.models import (
    ROLLUP_LEVELS,
    Checkpoint,
    LatestMetric,
    MetricPoint,
    MetricRollup,
    TrajectorySample,
)


def latest_metrics(*, run: Run) -> dict[str, float]:
    return dict(LatestMetric.objects.filter(run=run).values_list("key", "value"))


def latest_metric_rows(*, run: Run) -> list[tuple[str, int, float]]:
    """Every key's latest (key, step, value), by key: the raw metric table."""
    return list(LatestMetric.objects.filter(run=run).order_by("key").values_list("key", "step", "value"))


def run_last_step(*, run: Run) -> int | None:
    """The last step the trainer reported (the step of its ``version`` metric)."""
    return LatestMetric.objects.filter(run=run, key="version").values_list("step", flat=True).first()


def run_glance(*, run: Run, latest: dict[str, float]) -> dict[str, Any]:
    """What the run page's header shows: progress, the run's latest metrics (``latest``, from
    :func:`latest_metrics`) and, for reward and eval accuracy, their first value (the change
    since the start)."""
    first = {}
    for key in (M.REWARD_MEAN, M.EVAL_ACCURACY):
        value = (MetricPoint.objects.filter(run=run, key=key).order_by("step")
                 .values_list("value", flat=True).first())
        if value is not None:
            first[key] = value
    total = run_spec_resolved(run=run).trainer.steps  # the schema's default where unset
    return {"step": run_last_step(run=run), "total": total, "latest": latest, "first": first}


def latest_metrics_for_runs(*, runs: list[Run], keys: list[str]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {r.id: {} for r in runs}
    for run_id, key, value in LatestMetric.objects.filter(run__in=runs, key__in=keys).values_list(
            "run_id", "key", "value"):
        out[run_id][key] = value
    return out


X_AXES = ("step", "time", "tokens")
# A bucket may be up to this much wider than asked when that lets it read whole blocks of a
# coarser rollup level: a series then has at least buckets / LEVEL_SLACK points, and reads at
# most about 2.7 x buckets rows per key (the levels are 4x apart).
LEVEL_SLACK = 1.5
TOKENS_KEY = "tokens/consumed"
TOKENS_EXACT_UP_TO = 4096  # steps; beyond, the tokens axis reads 32-step blocks (interpolated)


def metric_series_get(*, run: Run, key: str, buckets: int = 500, x: str = "step") -> dict[str, Any]:
    """{"key", "step": [...], "mean", "min", "max", "downsampled": bool, "x": [...]}: one value
    per bucket of steps. ``x`` is the x-axis value of each point: its step, its wall time in
    seconds since the run's first step (``time``), or the tokens consumed up to it
    (``tokens``)."""
    return run_series(run=run, keys=[key], buckets=buckets, x=x)[0]


def run_series(*, run: Run, keys: list[str], buckets: int = 500, x: str = "step") -> list[dict[str, Any]]:
    """Several of a run's series on one x-axis (the axis' mapping is read once)."""
    axis = _XAxis(run, x)
    found = _series_batches([run], keys, buckets)[run.id]
    return [axis.add(dict(found[key])) for key in keys]


def _binary_cursor():
    """A cursor whose results PostgreSQL sends in its binary format: a chart read is thousands
    of float rows, and parsing their text cost 4x the CPU of unpacking them (the same values).
    Django's cursors bind parameters client-side, which allows text results only; this one
    binds them server-side. Queries are logged and errors translated as on Django's cursors."""
    if connection.vendor != "postgresql":
        return connection.cursor()
    import psycopg

    connection.ensure_connection()
    raw = psycopg.Cursor(connection.connection)
    raw.format = psycopg.pq.Format.BINARY
    return connection.make_debug_cursor(raw) if connection.queries_logged else connection.make_cursor(raw)


def _series_batches(runs: list[Run], keys: list[str],
                    buckets: int) -> dict[int, dict[str, dict[str, Any]]]:
    """:func:`_series_read` for each run, shared through the cache for
    ``settings.SERIES_CACHE_S`` seconds (one entry per run, keys and buckets). Callers reach it
    only for runs the user may read. The entries come in one round trip to the cache (a
    comparison's 8 runs took 8, each a wait when the host is busy), the runs missing are read
    and stored in one more."""
    ttl = settings.SERIES_CACHE_S
    if ttl <= 0:
        return {r.id: _series_read(r, keys, buckets) for r in runs}
    keys = list(dict.fromkeys(keys))
    digest = hashlib.sha1(json.dumps(keys).encode()).hexdigest()[:16]
    names = {r.id: f"oolong:series:{r.id}:{buckets}:{digest}" for r in runs}
    cached = cache.get_many(list(names.values()))
    found = {rid: cached.get(name) for rid, name in names.items()}
    missing = {r.id: _series_read(r, keys, buckets) for r in runs if found[r.id] is None}
    if missing:
        cache.set_many({names[rid]: series for rid, series in missing.items()}, ttl)
    return {**found, **missing}


def _series_read(run: Run, keys: list[str], buckets: int) -> dict[str, dict[str, Any]]:
    """Each key's series, bucketed in SQL, in at most three queries: the keys' step ranges from
    the coarsest rollup level, then one query for the keys whose buckets are wide enough for
    rollup blocks (they read the coarsest level whose blocks fit, with LEVEL_SLACK) and one for
    the others (they read the points: fewer than buckets * ROLLUP_STEPS rows), that one with
    its own planner settings first when it is big. Each series also carries ``time``, the
    latest wall time in each bucket."""
    keys = list(dict.fromkeys(keys))
    out = {k: {"key": k, "step": [], "mean": [], "min": [], "max": [], "time": [],
               "downsampled": False} for k in keys}
    if not keys:
        return out
    rollups, points = MetricRollup._meta.db_table, MetricPoint._meta.db_table
    marks = ", ".join(["%s"] * len(keys))
    with _binary_cursor() as cur:
        cur.execute(f"SELECT key, MIN(first_step), MAX(last_step) FROM {rollups} "
                    f"WHERE run_id = %s AND key IN ({marks}) AND level = %s GROUP BY key",
                    [run.id, *keys, len(ROLLUP_LEVELS) - 1])
        plans: dict[str, tuple[str, int, int, int]] = {}  # key -> (table, level, origin, width)
        point_rows = 0  # at most: the steps of the keys that read points
        for key, lo, hi in cur.fetchall():
            width = max(1, -(-(hi - lo + 1) // max(buckets, 1)))  # ceil division
            out[key]["downsampled"] = width > 1
            levels = [i for i, size in enumerate(ROLLUP_LEVELS) if size <= LEVEL_SLACK * width]
            if levels:  # whole blocks per bucket, counted from lo's block
                size = ROLLUP_LEVELS[levels[-1]]
                plans[key] = (rollups, levels[-1], lo // size, -(-width // size))
            else:
                plans[key] = (points, 0, lo, width)
                point_rows += hi - lo + 1
        for table, unit, columns in (
                (rollups, "block", "MAX(t.last_step), SUM(t.total) / SUM(t.n), MIN(t.low), "
                                   "MAX(t.high), MAX(t.wall_time)"),
                (points, "step", "MAX(t.step), AVG(t.value), MIN(t.value), MAX(t.value), "
                                 "MAX(t.wall_time)")):
            chosen = [k for k, plan in plans.items() if plan[0] == table]
            if not chosen:
                continue
            # Each key's bucket parameters come from a joined VALUES row (ordinal, key, level,
            # origin, width), grouped by the ordinal: a CASE over the keys, evaluated twice per
            # row, and a sort on the key's text were most of a 48-key read (2,000 steps: 94k
            # points, 169 ms before, 78 ms now, timed from the client). The WHERE keeps the
            # (key, level) pairs as index conditions.
            values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(chosen))
            where = (" OR ".join(["(t.key = %s AND t.level = %s)"] * len(chosen)) if table == rollups
                     else "t.key IN (" + ", ".join(["%s"] * len(chosen)) + ")")
            # Not inside a caller's transaction: the settings would outlive this read there.
            big = (table == points and point_rows > BIG_READ_ROWS
                   and connection.vendor == "postgresql" and not connection.in_atomic_block)
            with transaction.atomic() if big else contextlib.nullcontext():
                if big:
                    cur.execute(_BIG_READ_SETTINGS)
                cur.execute(
                    f"SELECT k.column1, {columns} FROM {table} t JOIN (VALUES {values}) AS k "
                    "ON t.key = k.column2" + (" AND t.level = k.column3" if table == rollups else "")
                    + f" WHERE t.run_id = %s AND ({where}) "
                    f"GROUP BY k.column1, (t.{unit} - k.column4) / k.column5 ORDER BY 1, 2",
                    [*(v for i, k in enumerate(chosen) for v in (i, k, *plans[k][1:])), run.id,
                     *(v for k in chosen for v in ((k, plans[k][1]) if table == rollups else (k,)))])
                found = cur.fetchall()
            # Ordered by the database and split into columns by zip: a run page's read is ~10k
            # rows, and a Python statement per row was a third of the request's CPU.
            for i, rows in itertools.groupby(found, key=operator.itemgetter(0)):
                _, steps, means, lows, highs, walls = zip(*rows, strict=True)
                series = out[chosen[i]]
                series["step"], series["mean"], series["min"], series["max"], series["time"] = (
                    list(steps), list(means), list(lows), list(highs), list(walls))
    return out


# A run page's read of a 2,000-step run aggregates ~100k points into ~20k buckets: with the
# default work_mem (4 MB) PostgreSQL sorts them on disk instead of hashing them in memory (103
# against 83 ms), may start parallel workers (on a small host they only add CPU) and, past a
# cost, JIT-compiles the statement (15-40 ms to save a few). Transaction-local, and only for
# reads this big: for a comparison's 16k points the three more round trips cost what they save.
BIG_READ_ROWS = 50_000
_BIG_READ_SETTINGS = ("SELECT set_config('work_mem', '16MB', true), set_config('jit', 'off', true), "
                      "set_config('max_parallel_workers_per_gather', '0', true)")


_UNREAD = object()


class _XAxis:
    """Turns a series' steps (and bucket times) into x values for one run."""

    def __init__(self, run: Run, x: str):
        if x not in X_AXES:
            raise ValueError(f"x must be one of {', '.join(X_AXES)}")
        self.run, self.x = run, x
        self._start: float | None = None
        self._tokens: tuple[list[int], list[float]] | None = None
        self._first: Any = _UNREAD  # the first version point's time, when a caller read it

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

    def first_known(self, first: float | None) -> None:
        """The first ``version`` point's wall time (None: there is none), read by the caller."""
        self._first = first

    def start(self, fallback: list[float]) -> float:
        """The wall time of the run's first step (its first ``version`` point: every trainer
        logs one), else the series' own first time."""
        if self._start is None:
            first = self._first
            if first is _UNREAD:
                first = (MetricPoint.objects.filter(run=self.run, key="version").order_by("step")
                         .values_list("wall_time", flat=True).first())
            self._start = first if first is not None else (min(fallback) if fallback else 0.0)
        return self._start

    def tokens(self) -> tuple[list[int], list[float]]:
        """(step, tokens consumed up to and including it), ascending: from every point for a
        short run, from the rollup blocks (their last steps) for a long one."""
        if self._tokens is None:
            rollups = MetricRollup.objects.filter(run=self.run, key=TOKENS_KEY)
            count = rollups.filter(level=len(ROLLUP_LEVELS) - 1).aggregate(n=Sum("n"))["n"] or 0
            if count <= TOKENS_EXACT_UP_TO:
                pairs = list(MetricPoint.objects.filter(run=self.run, key=TOKENS_KEY)
                             .order_by("step").values_list("step", "value"))
            else:
                pairs = list(rollups.filter(level=0).order_by("block")
                             .values_list("last_step", "total"))
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


REWARD_KEY, EVAL_KEY, RATE_KEY = M.REWARD_MEAN, M.EVAL_ACCURACY, M.TOKENS_PER_S
FINAL_POINTS = 10  # the final reward is the mean of the last this many steps


def runs_compare(*, runs: list[Run], keys: list[str], buckets: int = 300, x: str = "step",
                 target: float | None = None) -> dict[str, Any]:
    """What a comparison shows: every run's series of ``keys`` on one x-axis, and
    :func:`run_summaries` (its reward curve comes from the same read)."""
    axes = {r.id: _XAxis(r, x) for r in runs}
    tails = _tails_and_firsts(runs, axes)
    found = _series_batches(runs, [*keys, REWARD_KEY], buckets)
    return {"series": {r.id: [axes[r.id].add(dict(found[r.id][k])) for k in keys] for r in runs},
            "summary": run_summaries(runs=runs, target=target, axes=axes, tails=tails,
                                     rewards={rid: f[REWARD_KEY] for rid, f in found.items()})}


def _tails_and_firsts(runs: list[Run], axes: dict[int, _XAxis]) -> dict[int, list[float]]:
    """Each run's last FINAL_POINTS rewards (latest first), and into its axis the wall time of
    its first ``version`` point, in one statement (an index scan per run and item): two round
    trips per run before, the ones that cost the most when the database is busy
    (benchmarks/web_load.py)."""
    table = MetricPoint._meta.db_table
    parts, params = [], []
    for i, run in enumerate(runs):
        # Each LIMIT sits in a subquery of its own: a compound statement allows it there only.
        parts.append(f"SELECT * FROM (SELECT 0 AS item, run_id, step, value FROM {table} "
                     f"WHERE run_id = %s AND key = %s ORDER BY step DESC LIMIT {FINAL_POINTS}) AS t{i}")
        parts.append(f"SELECT * FROM (SELECT 1 AS item, run_id, step, wall_time FROM {table} "
                     f"WHERE run_id = %s AND key = %s ORDER BY step LIMIT 1) AS f{i}")
        params += [run.id, REWARD_KEY, run.id, M.VERSION]
    tails: dict[int, list[tuple[int, float]]] = {r.id: [] for r in runs}
    firsts: dict[int, float] = {}
    if parts:
        with connection.cursor() as cur:
            cur.execute(" UNION ALL ".join(parts), params)
            for item, run_id, step, value in cur.fetchall():
                if item == 0:
                    tails[run_id].append((step, value))
                else:
                    firsts[run_id] = value
    for run in runs:
        axes[run.id].first_known(firsts.get(run.id))
    return {rid: [v for _, v in sorted(t, reverse=True)] for rid, t in tails.items()}


def run_summaries(*, runs: list[Run], target: float | None = None,
                  axes: dict[int, _XAxis] | None = None,
                  rewards: dict[int, dict[str, Any]] | None = None,
                  tails: dict[int, list[float]] | None = None) -> dict[str, Any]:
    """What a comparison answers at a glance, per run: final reward (mean of the last
    FINAL_POINTS steps), final and best eval accuracy, mean tokens/s, steps and wall time, and
    the time (and step) the reward first reached ``target`` (smoothed over 5 points; default:
    90% of the best final reward among the runs). ``{"target": ..., "rows": [...]}``.

    Two queries for all runs together (evals; rates and last steps from the rollup blocks) and
    two per run (its last rewards, its first step's time; :func:`runs_compare` reads those for
    all runs in one and passes ``tails``); ``axes`` and ``rewards`` pass in what
    the caller has read already."""
    axes = axes or {r.id: _XAxis(r, "time") for r in runs}
    rewards = rewards or {rid: found[REWARD_KEY]
                          for rid, found in _series_batches(runs, [REWARD_KEY], 300).items()}
    evals: dict[int, list[tuple[int, float]]] = {r.id: [] for r in runs}
    for run_id, step, value in MetricPoint.objects.filter(run__in=runs, key=EVAL_KEY).values_list(
            "run_id", "step", "value"):
        evals[run_id].append((step, value))
    top = len(ROLLUP_LEVELS) - 1  # the fewest rows: the coarsest level holds the same totals
    # Mean tokens/s and the last step (and its time) of every run, in one statement.
    rates, lasts = {}, {}
    for r in (MetricRollup.objects.filter(run__in=runs, level=top, key__in=[RATE_KEY, "version"])
              .values("run_id", "key").annotate(total=Sum("total"), n=Sum("n"),
                                                step=Max("last_step"), wall=Max("wall_time"))):
        if r["key"] == RATE_KEY and r["n"]:
            rates[r["run_id"]] = r["total"] / r["n"]
        elif r["key"] == "version":
            lasts[r["run_id"]] = (r["step"], r["wall"])
    rows, curves = [], {}
    for run in runs:
        start = axes[run.id].start(rewards[run.id]["time"])
        curves[run.id] = {**rewards[run.id], "x": [t - start for t in rewards[run.id]["time"]]}
        tail = tails[run.id] if tails is not None else list(
            MetricPoint.objects.filter(run=run, key=REWARD_KEY).order_by("-step")
            .values_list("value", flat=True)[:FINAL_POINTS])
        points = sorted(evals[run.id])
        best = max(points, key=lambda p: (p[1], -p[0]), default=None)
        last = lasts.get(run.id)
        rows.append({
            "run_id": run.id, "name": run.name, "status": run.status,
            "steps": last[0] if last else None, "wall_s": last[1] - start if last else None,
            "final_reward": sum(tail) / len(tail) if tail else None,
            "final_eval": points[-1][1] if points else None,
            "best_eval": best[1] if best else None, "best_eval_step": best[0] if best else None,
            M.TOKENS_PER_S: rates.get(run.id),
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


# ---- evaluations (issue 48): eval/<set>/<metric>, each with its 95% interval ------------------

EVAL_CHART_METRICS = ("greedy_accuracy", "avg@k", "pass@k", "maj@k")  # charted, in this order


def run_eval_sets(*, run: Run) -> dict[str, list[str]]:
    """The eval sets a run has logged and, for each, the metrics of EVAL_CHART_METRICS it has
    (the run's own held-out set first, then by name)."""
    return runs_eval_sets(runs=[run])


def runs_eval_sets(*, runs: list[Run]) -> dict[str, list[str]]:
    """The union of :func:`run_eval_sets` over ``runs``."""
    found: dict[str, set[str]] = {}
    keys = (LatestMetric.objects.filter(run__in=runs, key__startswith="eval/")
            .values_list("key", flat=True).distinct())
    for key in keys:
        parts = key.split("/")
        if len(parts) == 3 and parts[2] in EVAL_CHART_METRICS:
            found.setdefault(parts[1], set()).add(parts[2])
    order = sorted(found, key=lambda name: (name != M.DEFAULT_EVAL_SET, name))
    return {name: [m for m in EVAL_CHART_METRICS if m in found[name]] for name in order}


def _eval_keys(set_name: str, metric: str) -> tuple[str, str, str, str]:
    """(value, interval low, interval high, weight version) keys of one eval metric."""
    return (f"eval/{set_name}/{metric}", f"eval/{set_name}/{metric}_ci_lo",
            f"eval/{set_name}/{metric}_ci_hi", f"eval/{set_name}/version")


def _eval_curve(found: dict[str, dict[str, Any]], axis: _XAxis, set_name: str,
                metric: str) -> dict[str, Any]:
    """One metric's curve from the bucketed series of its four keys: x, step, value, its
    interval (lo, hi) and the weight version evaluated, one entry per bucket of the value's
    series (the others are logged at the same steps, so their buckets end at the same steps)."""
    value_key, lo_key, hi_key, version_key = _eval_keys(set_name, metric)
    series = axis.add(dict(found[value_key]))
    at = {key: dict(zip(found[key]["step"], found[key][column], strict=True))
          for key, column in ((lo_key, "min"), (hi_key, "max"), (version_key, "max"))}
    return {"set": set_name, "metric": metric, "key": value_key, "x": series["x"],
            "step": series["step"], "value": series["mean"],
            "lo": [at[lo_key].get(s) for s in series["step"]],
            "hi": [at[hi_key].get(s) for s in series["step"]],
            "version": [None if at[version_key].get(s) is None else int(at[version_key][s])
                        for s in series["step"]],
            "downsampled": series["downsampled"]}


def run_eval_series(*, run: Run, buckets: int = 400, x: str = "step") -> list[dict[str, Any]]:
    """The run page's evaluation panel: for each eval set the run logged and each metric it has
    (greedy accuracy always; avg@k, pass@k and maj@k when the run sampled), the curve against
    ``x`` with its 95% interval and the weight version of each point. Downsampled as the other
    series are (a bucket's interval is the widest of its points'). Empty: no evals yet."""
    sets = run_eval_sets(run=run)
    pairs = [(name, metric) for name, metrics in sets.items() for metric in metrics]
    found = _series_batches([run], [k for p in pairs for k in _eval_keys(*p)], buckets)[run.id]
    axis = _XAxis(run, x)
    return [_eval_curve(found, axis, name, metric) for name, metric in pairs]


def _straddle(points: list[tuple[float, float, float, float]],
              target: float) -> tuple[float, float, float] | None:
    """(seconds, step, tokens) at which ``points`` (step, value, seconds, tokens; by step)
    first reach ``target``: linearly interpolated between the two evaluations that straddle it;
    the first evaluation's own when it already does; None when none does."""
    for i, (step, value, seconds, tokens) in enumerate(points):
        if value < target:
            continue
        if i == 0:
            return seconds, float(step), tokens
        step0, value0, seconds0, tokens0 = points[i - 1]
        f = (target - value0) / (value - value0)  # value0 < target <= value
        return (seconds0 + f * (seconds - seconds0), step0 + f * (step - step0),
                tokens0 + f * (tokens - tokens0))
    return None


def runs_eval_compare(*, runs: list[Run], set_name: str | None = None,
                      metric: str = "greedy_accuracy", x: str = "step",
                      target: float | None = None, buckets: int = 200) -> dict[str, Any]:
    """The compare view's evaluation: every run's curve of one eval ``metric`` of one eval set
    (default: the held-out set, else the first any run has) against ``x`` with its interval, and
    per run when it first reached ``target`` accuracy: wall time since its first step (its
    first ``version`` point, as the time axis), step and tokens consumed, each interpolated
    between the two evaluations that straddle the target (None: not reached). The default
    target is the lowest final value among the runs that have one (the time-to-accuracy
    benchmark's rule: every run reaches it)."""
    if metric not in EVAL_CHART_METRICS:
        raise ValueError(f"metric must be one of {', '.join(EVAL_CHART_METRICS)}")
    sets = runs_eval_sets(runs=runs)
    if set_name is None:
        set_name = next(iter(sets), M.DEFAULT_EVAL_SET)
    value_key, lo_key, hi_key, _ = keys = _eval_keys(set_name, metric)
    axes = {r.id: _XAxis(r, x) for r in runs}
    found = _series_batches(runs, list(keys), buckets)
    series = {r.id: _eval_curve(found[r.id], axes[r.id], set_name, metric) for r in runs}
    points: dict[int, list[tuple[int, float, float]]] = {r.id: [] for r in runs}
    lows, highs = {}, {}
    for run_id, key, step, value, wall in (
            MetricPoint.objects.filter(run__in=runs, key__in=[value_key, lo_key, hi_key])
            .order_by("run_id", "step").values_list("run_id", "key", "step", "value", "wall_time")):
        if key == value_key:
            points[run_id].append((step, value, wall))
        else:
            (lows if key == lo_key else highs)[(run_id, step)] = value
    finals = {rid: p[-1] for rid, p in points.items() if p}
    if target is None and finals:
        target = min(value for _, value, _ in finals.values())
    rows = []
    for run in runs:
        axis = axes[run.id]  # whatever its x: the tokens at any step, the run's start time
        start = axis.start([w for _, _, w in points[run.id]])
        steps, totals = axis.tokens()
        curve = [(s, v, w - start, _interpolate(steps, totals, s)) for s, v, w in points[run.id]]
        reached = _straddle(curve, target) if target is not None and curve else None
        final = finals.get(run.id)
        rows.append({
            "run_id": run.id, "name": run.name, "status": run.status,
            "evals": len(curve), "final": final[1] if final else None,
            "final_step": final[0] if final else None,
            "final_ci": ([lows.get((run.id, final[0])), highs.get((run.id, final[0]))]
                         if final else None),
            "reached": reached is not None,
            "minutes_to_target": reached[0] / 60 if reached else None,
            "step_to_target": reached[1] if reached else None,
            "tokens_to_target": reached[2] if reached else None,
        })
    return {"set": set_name, "metric": metric, "sets": sets, "target": target,
            "series": series, "rows": rows}
