"""Experiment-tracker speed on PostgreSQL: API ingest versus raw COPY, and chart-query latency.

    python benchmarks/tracker_ingest.py --quick --out bench-results/tracker_ingest.json

1. Ingest: the same metric points go (a) through the real API path — HTTP POSTs of 5,000-point
   batches to /api/ingest/metrics/ on a running web app (auth, validation, idempotent insert,
   latest-value upsert) — and (b) straight into the table with psycopg's COPY. Ratio = a / b.
2. Charts: a sweep of 10 runs x 5 metrics x 100k steps (30k with --quick) is loaded (by COPY,
   then the rollup blocks are built), then random (run, metric) series are fetched downsampled
   (500 buckets, min/max/mean per bucket in SQL, from the rollup blocks) and, as the naive
   baseline, point by point. p95 latencies in ms, plus the downsampled query through the API.
3. The sweep's comparison as the compare page asks for it: /api/runs/compare/ over its 10 runs
   with the page's 7 chart keys and bucket count (COMPARE_BUCKETS), the summary (final and best eval, time to target,
   tokens/s), on the step and on the wall-time axis. Aim: p95 under the chart aim (200 ms).

Uses the database named by --database-url (default: a scratch `oolong_bench` database on the
local PostgreSQL, created if missing and emptied first).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KEYS = ["reward/mean", "loss", "staleness/mean", "tokens_per_s", "grad_norm"]


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1] if len(xs) >= 20 else max(xs)


def ensure_database(url: str) -> None:
    import psycopg

    base, _, name = url.rpartition("/")
    with psycopg.connect(base + "/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def copy_points(run_id: int, rows) -> float:
    """COPY rows (key, step, value, time) for one run; returns seconds."""
    from django.db import connection

    from webapp.tracking.models import MetricPoint

    buf = io.StringIO()
    for key, step, value, t in rows:
        buf.write(f"{run_id}\t{key}\t{step}\t{value}\t{t}\n")
    data = buf.getvalue()
    start = time.perf_counter()
    with connection.cursor() as cur:
        with cur.connection.cursor().copy(
                f"COPY {MetricPoint._meta.db_table} (run_id, key, step, value, wall_time) FROM STDIN") as cp:
            cp.write(data)
    connection.commit() if not connection.get_autocommit() else None
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--database-url", default=os.environ.get(
        "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/oolong_bench"))
    parser.add_argument("--out", default="bench-results/tracker_ingest.json")
    args = parser.parse_args()
    ingest_points = 100_000 if args.quick else 500_000
    chart_runs = 10  # one sweep
    steps = 30_000 if args.quick else 100_000
    queries = 60 if args.quick else 200

    ensure_database(args.database_url)
    os.environ.update({"DATABASE_URL": args.database_url, "CELERY_BROKER_URL": "memory://",
                       "DJANGO_SETTINGS_MODULE": "webapp.config.settings.local",
                       "OOLONG_DATA_DIR": str(ROOT / ".cache" / "bench-webapp")})
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("flush", interactive=False, verbosity=0) if "tracking_metricpoint" in \
        connection.introspection.table_names() else None
    call_command("migrate", verbosity=0)

    import httpx

    from training_core.ports import free_port
    from webapp.accounts.services import project_create, token_get_or_create, user_create
    from webapp.dashboard.charts import COMPARE_BUCKETS, COMPARE_CHARTS
    from webapp.datasets.services import dataset_create_builtin
    from webapp.rewards.services import reward_function_create
    from webapp.runs.services import run_create
    from webapp.sweeps.services import sweep_create
    from webapp.tracking.models import MetricPoint, MetricRollup
    from webapp.tracking.selectors import metric_series_get, metric_series_naive
    from webapp.tracking.services import metric_rollups_rebuild

    user = user_create(username="bench", password="bench-pass-1")
    project = project_create(user=user, name="bench")
    dv = dataset_create_builtin(project=project, user=user, name="a", builtin="arithmetic", size=20)
    rv = reward_function_create(project=project, user=user, name="r", builtin="arithmetic")

    def new_run(name: str):
        return run_create(project=project, user=user, name=name, dataset_version=dv, reward_version=rv)

    rng = random.Random(0)
    n_steps = ingest_points // len(KEYS)
    rows = [(k, s, rng.random(), 1e9 + s) for s in range(n_steps) for k in KEYS]

    # ---- 1. API ingest over HTTP vs COPY ------------------------------------------------
    port = free_port()
    server = subprocess.Popen([sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}",
                               "--noreload", "--nothreading"], cwd=ROOT, env=os.environ.copy(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                httpx.get(base + "/accounts/login/", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        api_run = new_run("api")
        from webapp.runs.services import run_token_issue

        token = run_token_issue(run=api_run, purpose="benchmark")
        client = httpx.Client(base_url=base, timeout=120,
                              headers={"Authorization": f"Bearer {token}"})
        batch = 5000
        start = time.perf_counter()
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            r = client.post("/api/ingest/metrics/", json={"points": [
                {"key": k, "step": s, "value": v, "time": t} for k, s, v, t in chunk]})
            r.raise_for_status()
        api_s = time.perf_counter() - start
        assert MetricPoint.objects.filter(run=api_run).count() == len(rows)

        copy_run = new_run("copy")
        copy_s = copy_points(copy_run.id, rows)
        assert MetricPoint.objects.filter(run=copy_run).count() == len(rows)

        # ---- 2. chart queries ---------------------------------------------------------------
        sweep = sweep_create(project=project, user=user, name="chart", dataset_version=dv,
                             reward_version=rv, spec={}, axes=[
                                 {"field": "trainer.lr", "values": [1e-4 * (i + 1) for i in range(chart_runs)]}])
        chart = list(sweep.runs.order_by("id"))
        load_start = time.perf_counter()
        for run in chart:
            copy_points(run.id, ((k, s, rng.random(), 1e9 + s) for s in range(steps) for k in KEYS))
        load_s = time.perf_counter() - load_start
        rollup_start = time.perf_counter()
        for run in chart:  # COPY went around the ingest, which keeps them
            metric_rollups_rebuild(run=run)
        rollup_s = time.perf_counter() - rollup_start
        with connection.cursor() as cur:  # as autovacuum would, some time after a load
            cur.execute(f"ANALYZE {MetricPoint._meta.db_table}")
            cur.execute(f"ANALYZE {MetricRollup._meta.db_table}")
        picks = [(rng.choice(chart), rng.choice(KEYS)) for _ in range(queries)]
        metric_series_get(run=chart[0], key=KEYS[0])  # warm caches once, as a live server would be
        down, naive, api_ms = [], [], []
        for run, key in picks:
            t = time.perf_counter()
            series = metric_series_get(run=run, key=key, buckets=500)
            down.append((time.perf_counter() - t) * 1000)
            assert len(series["step"]) <= 500
        for run, key in picks[: max(20, queries // 3)]:
            t = time.perf_counter()
            full = metric_series_naive(run=run, key=key)
            naive.append((time.perf_counter() - t) * 1000)
            assert len(full["step"]) == steps
        user_api = httpx.Client(base_url=base, timeout=60,
                                headers={"Authorization": f"Token {token_get_or_create(user=user)}"})
        for run, key in picks[:40]:
            t = time.perf_counter()
            user_api.get(f"/api/runs/{run.id}/metrics/", params={"keys": key, "buckets": 500}).raise_for_status()
            api_ms.append((time.perf_counter() - t) * 1000)

        # ---- 3. the sweep's comparison, as the compare page asks for it -----------------------
        compare_keys = ",".join(k for _, keys in COMPARE_CHARTS for k in keys)
        ids = ",".join(str(r.id) for r in chart)
        compare_ms: dict[str, list[float]] = {"step": [], "time": []}
        for i in range(30 if args.quick else 60):
            x = "step" if i % 2 == 0 else "time"
            t = time.perf_counter()
            resp = user_api.get("/api/runs/compare/", params={"ids": ids, "keys": compare_keys,
                                                              "buckets": COMPARE_BUCKETS, "x": x})
            compare_ms[x].append((time.perf_counter() - t) * 1000)
            resp.raise_for_status()
            body = resp.json()
            assert len(body["summary"]["rows"]) == chart_runs
            assert all(len(s["x"]) <= COMPARE_BUCKETS for series in body["series"].values()
                       for s in series)
    finally:
        server.terminate()
        server.wait(timeout=10)

    out = {
        "points": len(rows),
        "points_per_s": len(rows) / api_s,
        "copy_points_per_s": len(rows) / copy_s,
        "api_vs_copy_ratio": copy_s / api_s,
        "chart_p95_ms": p95(down),
        "chart_median_ms": statistics.median(down),
        "naive_chart_p95_ms": p95(naive),
        "api_chart_p95_ms": p95(api_ms),
        "sweep_compare_p95_ms": p95(compare_ms["step"]),
        "sweep_compare_time_axis_p95_ms": p95(compare_ms["time"]),
        "chart_aim_ms": 200,
        "chart_series": {"runs": chart_runs, "metrics": len(KEYS), "steps": steps,
                         "points_total": chart_runs * len(KEYS) * steps, "load_s": load_s,
                         "rollup_build_s": rollup_s},
        "config": {"quick": args.quick, "batch_points": 5000, "buckets": 500, "queries": queries},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
