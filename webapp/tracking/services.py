"""Ingest from trainers. Every write is idempotent: a retried batch never duplicates anything."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import psycopg
from django.db import connection, models, transaction

from webapp.core.errors import ApplicationError
from webapp.core.json_input import MAX_DEPTH, json_check
from webapp.core.parsers import nested_deeper_than
from webapp.runs.models import Run
from webapp.tracking.models import (
    ROLLUP_LEVELS,
    ROLLUP_STEPS,
    Checkpoint,
    LatestMetric,
    MetricPoint,
    MetricRollup,
    RunIngestUsage,
    TrajectorySample,
)

MAX_POINTS_PER_BATCH = 50_000


INT64 = (-(2**63), 2**63 - 1)  # BigIntegerField: a larger number is a 400, not a database error


def _int64(value: Any, field: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ApplicationError("must be an integer", field=field) from None
    if not INT64[0] <= number <= INT64[1] or isinstance(value, float) and value != number:
        raise ApplicationError(f"must be an integer between {INT64[0]} and {INT64[1]}",
                               field=field)
    return number


def _clean_points(points: list[dict[str, Any]]) -> list[tuple[str, int, float, float]]:
    if len(points) > MAX_POINTS_PER_BATCH:
        raise ApplicationError(f"at most {MAX_POINTS_PER_BATCH} points per batch", field="points")
    out: dict[tuple[str, int], tuple[str, int, float, float]] = {}
    now = time.time()
    lo, hi = INT64
    for i, p in enumerate(points):
        try:
            # null: a value the trainer could not send (NaN, inf): not plottable, skipped
            key, step, raw = str(p["key"]), p["step"], p["value"]
            value = math.nan if raw is None else float(raw)
            wall = p.get("time") or now
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ApplicationError("each point needs key (text), step (integer), value (number)",
                                   field=f"points[{i}]") from None
        if not key or len(key) > 100 or "\x00" in key:
            raise ApplicationError("key must be 1-100 characters, no NUL", field=f"points[{i}].key")
        if type(step) is not int or not lo <= step <= hi:  # the common case checks no further
            step = _int64(step, f"points[{i}].step")
        if type(wall) is not float:
            try:
                wall = float(wall)
            except (TypeError, ValueError):
                raise ApplicationError("must be a Unix time in seconds",
                                       field=f"points[{i}].time") from None
        if not math.isfinite(value):
            continue  # not plottable; a NaN loss is reported as an event by the trainer
        if not math.isfinite(wall):
            raise ApplicationError("must be a Unix time in seconds", field=f"points[{i}].time")
        out[(key, step)] = (key, step, value, wall)
    # A step sent twice in one batch: the later point wins, as if sent in two batches (one
    # insert statement may not touch a row twice).
    return list(out.values())


# ---- per-run bounds (issue 47): what one run may store through the ingest API ---------------


def _limit_reached(run: Run, what: str, message: str) -> None:
    """One ``ingest_limit`` event per kind of bound, however often it is hit."""
    from webapp.runs.services import run_event_add

    run_event_add(run=run, kind="ingest_limit", message=message, dedup_key=f"ingest-limit-{what}")


def _usage(run: Run) -> RunIngestUsage:
    """The run's counters, locked until the caller's transaction ends."""
    RunIngestUsage.objects.get_or_create(run=run)
    return RunIngestUsage.objects.select_for_update().get(run=run)


def _within_key_bound(run: Run, rows: list[tuple[str, int, float, float]]
                      ) -> tuple[list[tuple[str, int, float, float]], int]:
    """The points whose keys the run has, or may still add (settings.INGEST_MAX_METRIC_KEYS),
    and how many points of keys beyond the bound were dropped."""
    from django.conf import settings

    keys = {row[0] for row in rows}
    known = set(LatestMetric.objects.filter(run=run, key__in=keys).values_list("key", flat=True))
    new = sorted(keys - known)
    if not new:
        return rows, 0
    room = max(0, settings.INGEST_MAX_METRIC_KEYS - LatestMetric.objects.filter(run=run).count())
    refused = set(new[room:])
    if not refused:
        return rows, 0
    kept = [row for row in rows if row[0] not in refused]
    _limit_reached(run, "metric-keys", f"this run reached its {settings.INGEST_MAX_METRIC_KEYS:,} "
                   f"metric keys (OOLONG_INGEST_MAX_METRIC_KEYS): points of new keys are dropped, "
                   f"e.g. {sorted(refused)[0][:100]!r}")
    return kept, len(rows) - len(kept)


def metrics_ingest(*, run: Run, points: list[dict[str, Any]]) -> int:
    """Store points by (run, key, step). A retried batch changes nothing; a point with a
    different value for a stored step (a resumed run re-training the steps after its checkpoint)
    replaces it. Points of keys beyond the run's bound on metric keys are dropped (an
    ``ingest_limit`` event says so). Returns the number of points new or changed."""
    rows, _ = _within_key_bound(run, _clean_points(points))
    if not rows:
        return 0
    with transaction.atomic():
        if connection.vendor == "postgresql":
            changed = _ingest_postgres(run.id, rows)
        else:
            changed = _ingest_portable(run, rows)
        _rollups_recompute(run.id, changed)
        _latest_upsert(run, rows)
    return len(changed)


def _ingest_postgres(run_id: int, rows: list[tuple[str, int, float, float]]) -> list[tuple[str, int]]:
    """New steps, the common case (a trainer reporting as it goes), are copied in: COPY costs a
    third of the upsert. A batch holding any stored step (a retry, a resumed run training steps
    again) fails the copy, which leaves nothing behind (a savepoint), and takes the upsert."""
    table = MetricPoint._meta.db_table
    try:
        with transaction.atomic(), connection.cursor() as cur, cur.copy(
                f"COPY {table} (run_id, key, step, value, wall_time) FROM STDIN") as copy:
            for key, step, value, wall in rows:
                copy.write_row((run_id, key, step, value, wall))
        return [(key, step) for key, step, _, _ in rows]
    except psycopg.errors.UniqueViolation:
        return _upsert_postgres(run_id, rows)


def _upsert_postgres(run_id: int, rows: list[tuple[str, int, float, float]]) -> list[tuple[str, int]]:
    # One statement with arrays: far faster than row-by-row ORM inserts, still idempotent (an
    # identical point is not touched, so it is not returned either).
    keys, steps, values, times = (list(c) for c in zip(*rows, strict=True))
    table = MetricPoint._meta.db_table
    with connection.cursor() as cur:
        cur.execute(
            f"INSERT INTO {table} AS m (run_id, key, step, value, wall_time) "
            "SELECT %s, k, s, v, t FROM unnest(%s::text[], %s::bigint[], %s::float8[], %s::float8[]) "
            "AS u(k, s, v, t) ON CONFLICT (run_id, key, step) DO UPDATE "
            "SET value = EXCLUDED.value, wall_time = EXCLUDED.wall_time "
            "WHERE m.value IS DISTINCT FROM EXCLUDED.value RETURNING m.key, m.step",
            [run_id, keys, steps, values, times])
        return cur.fetchall()


def _ingest_portable(run: Run, rows: list[tuple[str, int, float, float]]) -> list[tuple[str, int]]:
    """The same rule on other databases (SQLite for the demo), a few more queries."""
    stored = dict(((k, s), v) for k, s, v in MetricPoint.objects.filter(
        run=run, key__in={r[0] for r in rows}, step__in={r[1] for r in rows}).values_list(
        "key", "step", "value"))
    changed = {(k, s): (v, t) for k, s, v, t in rows if stored.get((k, s)) != v}
    MetricPoint.objects.bulk_create(
        [MetricPoint(run_id=run.id, key=k, step=s, value=v, wall_time=t)
         for (k, s), (v, t) in changed.items()],
        update_conflicts=True, unique_fields=["run", "key", "step"],
        update_fields=["value", "wall_time"], batch_size=2000)
    return list(changed)


def _floor_div(column: str, by: int) -> str:
    """SQL floor division of ``column`` by ``by``, negative values included (SQL truncates)."""
    return f"CASE WHEN {column} >= 0 THEN {column} / {by} ELSE ({column} + 1) / {by} - 1 END"


_FANOUT = ROLLUP_LEVELS[1] // ROLLUP_LEVELS[0]  # blocks per block of the next level
_SET = ("n = excluded.n, total = excluded.total, low = excluded.low, high = excluded.high, "
        "first_step = excluded.first_step, last_step = excluded.last_step, "
        "wall_time = excluded.wall_time")


def _rollups_recompute(run_id: int, changed: list[tuple[str, int]]) -> None:
    """Recompute, from the points themselves, the level-0 rollup blocks that hold a new or
    changed point (so a retried or replaced batch leaves them exact), then each level above
    from the one below. Trainers send consecutive steps, every key over the same steps: the keys
    that share a step range take one statement per level (``key = ANY(...)``, an index scan of
    the unique index), not one per key and level: 41 keys cost 205 statements, ~5x the time of the
    grouped 10, and 32 runs ingesting at once saturated PostgreSQL (benchmarks/web_load.py).
    (One statement for all keys joined to their own ranges was slower still: the planner scans
    the run's points.)"""
    spans: dict[str, tuple[int, int]] = {}
    for key, step in changed:
        lo, hi = spans.get(key, (step, step))
        spans[key] = (min(lo, step), max(hi, step))
    by_span: dict[tuple[int, int], list[str]] = {}
    for key, span in spans.items():
        by_span.setdefault(span, []).append(key)
    # At most 500 keys a statement: SQLite's limit on parameters.
    groups = [(span, keys[i:i + 500]) for span, keys in by_span.items() for i in range(0, len(keys), 500)]
    points, rollups = MetricPoint._meta.db_table, MetricRollup._meta.db_table
    columns = "(run_id, key, level, block, n, total, low, high, first_step, last_step, wall_time)"
    from_points = (
        f"INSERT INTO {rollups} {columns} SELECT run_id, key, 0, "
        f"{_floor_div('step', ROLLUP_STEPS)}, COUNT(*), SUM(value), MIN(value), MAX(value), "
        f"MIN(step), MAX(step), MAX(wall_time) FROM {points} "
        "WHERE run_id = %s AND {keys} AND step >= %s AND step <= %s "
        f"GROUP BY run_id, key, {_floor_div('step', ROLLUP_STEPS)} "
        f"ON CONFLICT (run_id, key, level, block) DO UPDATE SET {_SET}")
    from_below = (
        f"INSERT INTO {rollups} {columns} SELECT run_id, key, %s, "
        f"{_floor_div('block', _FANOUT)}, SUM(n), SUM(total), MIN(low), MAX(high), "
        f"MIN(first_step), MAX(last_step), MAX(wall_time) FROM {rollups} "
        "WHERE run_id = %s AND {keys} AND level = %s AND block >= %s AND block <= %s "
        f"GROUP BY run_id, key, {_floor_div('block', _FANOUT)} "
        f"ON CONFLICT (run_id, key, level, block) DO UPDATE SET {_SET}")
    postgres = connection.vendor == "postgresql"
    with connection.cursor() as cur:
        for (lo, hi), keys in groups:
            # PostgreSQL takes the keys as one array: the statement's text is then the same for
            # every batch and its parse is cached by the driver (not past 50 parameters), which
            # was a quarter of a batch's CPU. IN (...) elsewhere: SQLite (the demo) has no arrays.
            marks, params = ("key = ANY(%s::text[])", [keys]) if postgres else (
                f"key IN ({', '.join(['%s'] * len(keys))})", keys)
            size = ROLLUP_LEVELS[0]
            cur.execute(from_points.format(keys=marks), [
                run_id, *params, max(lo // size * size, INT64[0]),
                min((hi // size + 1) * size - 1, INT64[1])])
            for level in range(1, len(ROLLUP_LEVELS)):
                size = ROLLUP_LEVELS[level]
                # Every child block of the touched blocks of this level.
                cur.execute(from_below.format(keys=marks), [
                    level, run_id, *params, level - 1, lo // size * _FANOUT,
                    (hi // size + 1) * _FANOUT - 1])


def metric_rollups_rebuild(*, run: Run) -> None:
    """Every rollup block of the run from its points (points loaded around the ingest, such as
    a benchmark's COPY, or points from before rollups existed)."""
    with transaction.atomic():
        MetricRollup.objects.filter(run=run).delete()
        spans = MetricPoint.objects.filter(run=run).values("key").annotate(
            lo=models.Min("step"), hi=models.Max("step"))
        for span in spans:
            _rollups_recompute(run.id, [(span["key"], span["lo"]), (span["key"], span["hi"])])


def _latest_upsert(run: Run, rows: list[tuple[str, int, float, float]]) -> None:
    """Each key's latest (step, value): one statement; an older step never moves it back."""
    latest: dict[str, tuple[int, float]] = {}
    for key, step, value, _ in rows:
        if key not in latest or step >= latest[key][0]:
            latest[key] = (step, value)
    table = LatestMetric._meta.db_table
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":  # four arrays: a statement the driver caches
            keys, steps, values = (list(c) for c in zip(
                *((k, s, v) for k, (s, v) in latest.items()), strict=True))
            cur.execute(
                f"INSERT INTO {table} AS m (run_id, key, step, value) SELECT %s, k, s, v "
                "FROM unnest(%s::text[], %s::bigint[], %s::float8[]) AS u(k, s, v) "
                "ON CONFLICT (run_id, key) DO UPDATE SET step = excluded.step, "
                "value = excluded.value WHERE excluded.step >= m.step",
                [run.id, keys, steps, values])
            return
        cur.execute(
            f"INSERT INTO {table} AS m (run_id, key, step, value) VALUES "
            + ", ".join(["(%s, %s, %s, %s)"] * len(latest))
            + " ON CONFLICT (run_id, key) DO UPDATE SET step = excluded.step, "
            "value = excluded.value WHERE excluded.step >= m.step",
            [v for key, (step, value) in latest.items() for v in (run.id, key, step, value)])


def trajectories_ingest(*, run: Run, samples: list[dict[str, Any]]) -> int:
    """Store samples by (run, step, index); a sample already stored is left as it was (a retried
    batch changes nothing). A run stores at most settings.INGEST_MAX_TRAJECTORIES samples and
    INGEST_MAX_TRAJECTORY_BYTES of them: what does not fit is dropped, and an ``ingest_limit``
    event says so. Returns the number of samples received within the bounds."""
    rows = []
    for i, s in enumerate(samples):
        try:
            step = _int64(s["step"], f"samples[{i}].step")
            index = _int64(s.get("index", i), f"samples[{i}].index")
            if not 0 <= index <= 2**31 - 1:
                raise ApplicationError("must be between 0 and 2147483647", field=f"samples[{i}].index")
            rows.append({"step": step, "index": index, "prompt": str(s["prompt"]),
                         "completion": str(s["completion"]), "reward": float(s["reward"]),
                         "tokens": list(s.get("tokens", [])),
                         "token_versions": list(s.get("token_versions", [])),
                         "info": dict(s.get("info", {}))})
        except (KeyError, TypeError, ValueError):
            raise ApplicationError("each sample needs step, prompt, completion, reward",
                                   field=f"samples[{i}]") from None
    with transaction.atomic():
        usage = _usage(run)
        rows, document = _within_trajectory_bounds(run, usage, rows)
        if not rows:
            return 0
        inserted = _insert_samples(run, rows, document)
        usage.trajectories += inserted
        usage.trajectory_bytes += len(document) * inserted // len(rows)
        usage.save(update_fields=["trajectories", "trajectory_bytes"])
    return len(rows)


def _within_trajectory_bounds(run: Run, usage: RunIngestUsage, rows: list[dict[str, Any]]
                              ) -> tuple[list[dict[str, Any]], str]:
    """The samples that fit the run's bounds (all of them, in the common case: one encode), and
    their JSON document."""
    from django.conf import settings

    count_left = settings.INGEST_MAX_TRAJECTORIES - usage.trajectories
    bytes_left = settings.INGEST_MAX_TRAJECTORY_BYTES - usage.trajectory_bytes
    document = _samples_document(rows)
    if len(rows) <= count_left and len(document) <= bytes_left:
        return rows, document
    kept, size = [], 0
    for row in rows[:max(0, count_left)]:
        size += len(json.dumps(row)) + 2
        if size > bytes_left:
            break
        kept.append(row)
    _limit_reached(run, "trajectories", f"this run reached its bound on stored samples "
                   f"({settings.INGEST_MAX_TRAJECTORIES:,} samples, "
                   f"{settings.INGEST_MAX_TRAJECTORY_BYTES >> 20:,} MB: OOLONG_INGEST_MAX_"
                   f"TRAJECTORIES, OOLONG_INGEST_MAX_TRAJECTORY_MB): later samples are dropped")
    return kept, (_samples_document(kept) if kept else "[]")


def _insert_samples(run: Run, rows: list[dict[str, Any]], document: str) -> int:
    """Insert, leaving stored samples as they are; returns how many were new."""
    if connection.vendor == "postgresql":
        # One statement over one JSON document (encoded in C): the ORM's bulk insert quoted every
        # token of every sample into a PostgreSQL array literal in Python, ~half the request.
        table = TrajectorySample._meta.db_table
        # A savepoint in a caller's transaction: a batch the database refuses (a lone surrogate
        # in a text: a 400) leaves that transaction usable.
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(
                f'INSERT INTO {table} (run_id, step, "index", prompt, completion, reward, tokens, '
                "token_versions, info) SELECT %s, step, \"index\", prompt, completion, reward, tokens, "
                "token_versions, info FROM jsonb_to_recordset(%s::jsonb) AS x(step bigint, "
                '"index" integer, prompt text, completion text, reward float8, tokens jsonb, '
                "token_versions jsonb, info jsonb) ON CONFLICT (run_id, step, \"index\") DO NOTHING",
                [run.id, document])
            return max(cur.rowcount, 0)
    objs = [TrajectorySample(run=run, **row) for row in rows]
    return len(TrajectorySample.objects.bulk_create(objs, ignore_conflicts=True))


def events_ingest(*, run: Run, events: list[dict[str, Any]]) -> int:
    """Store a trainer's events (a retried one, by its dedup key, once). A run stores at most
    settings.INGEST_MAX_EVENTS through ingest: later ones are dropped, and an ``ingest_limit``
    event says so. Returns how many were stored."""
    from django.conf import settings

    from webapp.runs.services import run_event_add

    stored = 0
    with transaction.atomic():
        usage = _usage(run)
        left = settings.INGEST_MAX_EVENTS - usage.events
        for i, e in enumerate(events):
            if stored >= left:
                _limit_reached(run, "events", f"this run reached its {settings.INGEST_MAX_EVENTS:,} "
                               "events (OOLONG_INGEST_MAX_EVENTS): later events are dropped")
                break
            ev = run_event_add(run=run, kind=e["kind"], message=e["message"],
                               data=json_check(e["data"], f"events[{i}].data"),
                               dedup_key=e["dedup_key"])
            stored += ev is not None
        usage.events += stored
        usage.save(update_fields=["events"])
    return stored


def _samples_document(rows: list[dict[str, Any]]) -> str:
    """The samples as one JSON text, after the checks json_check makes (no NUL, finite numbers,
    bounded depth). The encoder checks the whole batch at C speed; only a batch it refuses, or
    whose text holds an escaped NUL or may nest too deep, is walked in Python, sample by sample,
    to name the bad field (a 400)."""
    try:
        document = json.dumps(rows, allow_nan=False)
    except ValueError:
        document = None
    if document is None or "\\u0000" in document or any(
            nested_deeper_than(row, MAX_DEPTH) for row in rows):
        for i, row in enumerate(rows):
            json_check({k: v for k, v in row.items() if k not in ("step", "index")}, f"samples[{i}]")
        # json_check passed: nothing is left for the encoder to refuse.
        document = json.dumps(rows, allow_nan=False)
    return document


def checkpoint_record(*, run: Run, step: int, version: int, path: str) -> Checkpoint:
    return Checkpoint.objects.update_or_create(run=run, step=step,
                                               defaults={"version": version, "path": path})[0]

