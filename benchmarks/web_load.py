"""The production web stack under load: 32 runs ingesting at full speed while 16 users browse.

    python benchmarks/web_load.py --quick --out bench-results/web_load_quick.json

The stack is the one an operator runs (docs/operations.md): ``scripts/serve.sh`` (migrations, then
gunicorn with gthread workers) on the production settings, and a second ``scripts/serve.sh`` with
``OOLONG_WEB_POOL=ingest``, the pool the proxy sends ``/api/ingest/`` to (``--single-pool``: one
pool serves everything, the setup before); PostgreSQL, Redis as the shared cache and the Celery
broker. Everything talks to 127.0.0.1 only: the ingesters post to the ingest pool's port
directly, as the proxy would forward them.

- 32 ingesters, one per run, speak the trainer's protocol (training_core/tracking_sink.py) with
  the run's ingest token: report ``running``, then, without pausing, POST a batch of metric
  points (``--steps-per-post`` steps x every key a trainer logs) and that batch's trajectory
  samples (4 per step, as train.py's ``sample_records``). A 5xx or a dropped connection is retried
  as the sink retries, so every point is eventually delivered or counted lost.
- 16 users, each logged in through the login page before the clock starts (session cookie)
  and holding an API token, do what the browser does for a page, with a think time between
  pages: the run page (HTML,
  then its charts, trajectories, run and events calls, one after another as charts.js does), the
  compare page (HTML, then /api/runs/compare/ over 8 live runs with the page's keys and bucket
  count), the run list, and API calls (run list, a run's metrics, a comparison).
- Afterwards every run's points and samples are counted with SQL and compared with what was
  sent: ``points_lost``, ``samples_lost``.

Reported (JSON): per endpoint requests, requests/s, p50/p95/p99/max ms, 4xx and 5xx; per page
(a page load: its requests in order) the same latencies; ingest throughput; ``errors_5xx``;
``points_lost``; the aims (0 5xx, compare view p95 < 1 s). Each run's history (``--history-steps``
steps per run) is loaded by COPY first, so charts read rollups of a run in progress.

The two client groups run in two processes of their own so that encoding 32 ingest streams does
not delay the users' clock. Client and server share the machine: say so when quoting figures.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMPARE_RUNS = 8
SAMPLES_PER_STEP = 4
AIM_COMPARE_P95_MS = 1000.0
# The pages whose full load the compare aim is about, and the requests they are made of.
COMPARE_ENDPOINTS = ("GET /compare/", "GET /api/runs/compare/")


# ---- the report (pure: tests/benchmarks/test_web_load_shape.py calls it) ---------------------

def latency_summary(latencies_s: list[float]) -> dict[str, float | None]:
    """p50/p95/p99/max in ms; percentiles by linear interpolation between the order statistics
    (statistics.quantiles, 'inclusive'): one sample gives that sample everywhere."""
    if not latencies_s:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}
    ms = sorted(x * 1000 for x in latencies_s)
    if len(ms) == 1:
        q = [ms[0]] * 99
    else:
        q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": q[49], "p95_ms": q[94], "p99_ms": q[98], "max_ms": ms[-1]}


def _group(records: list[dict[str, Any]], duration_s: float) -> dict[str, dict[str, Any]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    out = {}
    for name, rs in sorted(by.items()):
        ok = [r["latency_s"] for r in rs if r["status"] is not None and r["status"] < 400]
        out[name] = {
            "requests": len(rs),
            "requests_per_s": len(rs) / duration_s,
            **latency_summary(ok),
            "ok": len(ok),
            "errors_4xx": sum(1 for r in rs if r["status"] is not None and 400 <= r["status"] < 500),
            "errors_5xx": sum(1 for r in rs if r["status"] is not None and r["status"] >= 500),
            "transport_errors": sum(1 for r in rs if r["status"] is None),
        }
        kinds: dict[str, int] = {}
        for r in rs:
            if r["status"] is None:
                kinds[r.get("error", "?")] = kinds.get(r.get("error", "?"), 0) + 1
        if kinds:
            out[name]["transport_error_kinds"] = kinds
    return out


def build_report(*, requests: list[dict[str, Any]], pages: list[dict[str, Any]], duration_s: float,
                 sent: dict[str, int], stored: dict[str, int], config: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's JSON from raw observations.

    ``requests``: one dict per HTTP request: ``name`` ("METHOD /path/{id}/"), ``status`` (None for
    a transport error: refused, reset, timed out) and ``latency_s``. ``pages``: one per page load,
    ``name`` and ``status`` (the worst of its requests) and ``latency_s`` (all of them, in order).
    ``sent``: ``points`` and ``samples`` the ingesters had acknowledged plus the history loaded;
    ``stored``: the same counted in the database afterwards."""
    endpoints = _group(requests, duration_s)
    page_stats = _group(pages, duration_s)
    ingest = {k: v for k, v in endpoints.items() if "/api/ingest/" in k}
    errors_5xx = sum(e["errors_5xx"] for e in endpoints.values())
    compare_p95 = [page_stats[n]["p95_ms"] for n in ("compare page",) if n in page_stats
                   and page_stats[n]["p95_ms"] is not None]
    compare_view_p95 = compare_p95[0] if compare_p95 else None
    points_lost = max(0, sent["points"] - stored["points"])
    samples_lost = max(0, sent["samples"] - stored["samples"])
    return {
        "duration_s": duration_s,
        "errors_5xx": errors_5xx,
        "errors_4xx": sum(e["errors_4xx"] for e in endpoints.values()),
        "transport_errors": sum(e["transport_errors"] for e in endpoints.values()),
        "points_lost": points_lost,
        "samples_lost": samples_lost,
        "points_extra": max(0, stored["points"] - sent["points"]),
        "sent": sent,
        "stored": stored,
        "throughput": {
            "requests_per_s": len(requests) / duration_s,
            "ingest_requests_per_s": sum(e["requests"] for e in ingest.values()) / duration_s,
            "points_per_s": (sent["points"] - sent.get("history_points", 0)) / duration_s,
            "samples_per_s": (sent["samples"] - sent.get("history_samples", 0)) / duration_s,
            "user_requests_per_s": sum(e["requests"] for k, e in endpoints.items()
                                       if k not in ingest) / duration_s,
            "pages_per_s": len(pages) / duration_s,
        },
        "compare_view_p95_ms": compare_view_p95,
        "aims": {
            "errors_5xx": 0,
            "compare_view_p95_ms": AIM_COMPARE_P95_MS,
            "met": errors_5xx == 0 and points_lost == 0 and samples_lost == 0
                   and compare_view_p95 is not None and compare_view_p95 < AIM_COMPARE_P95_MS,
        },
        "endpoints": endpoints,
        "pages": page_stats,
        "config": config,
    }


# ---- the load ---------------------------------------------------------------------------------

def metric_keys() -> list[str]:
    """Every key the run and compare pages chart, plus what a trainer logs besides."""
    from webapp.dashboard.charts import COMPARE_CHARTS, RUN_CHART_GROUPS

    keys = [k for _, _, charts in RUN_CHART_GROUPS for _, ks in charts for k in ks]
    keys += [k for _, ks in COMPARE_CHARTS for k in ks]
    keys += ["tokens/consumed", "reward/std", "rollout/queue_depth", "rollout/running",
             "update/computed_rows_frac", "time/step_s"]
    return list(dict.fromkeys(keys))


def _points(keys: list[str], step: int, now: float, rng: random.Random) -> list[dict[str, Any]]:
    return [{"key": k, "step": step, "value": (step * 64 if k == "tokens/consumed" else rng.random()),
             "time": now} for k in keys if k != "eval/accuracy" or step % 10 == 0]


def _samples(step: int, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for i in range(SAMPLES_PER_STEP):
        n = rng.randint(40, 160)
        out.append({"step": step, "index": i,
                    "prompt": f"What is {rng.randint(1, 999)} + {rng.randint(1, 999)}? " * 4,
                    "completion": " ".join(f"tok{j}" for j in range(n)),
                    "reward": rng.random(), "info": {"extracted": str(rng.randint(0, 2000)),
                                                     "extract": "auto", "dropped_stale": False},
                    "tokens": [f"tok{j} " for j in range(n)],
                    "token_versions": [step // 4] * n})
    return out


class Recorder:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def call(self, client, method: str, url: str, name: str, **kw):
        t = time.perf_counter()
        try:
            resp = await client.request(method, url, **kw)
        except Exception as exc:  # transport: refused, reset, timed out: counted, never fatal
            self.requests.append({"name": name, "status": None, "latency_s": time.perf_counter() - t,
                                  "error": type(exc).__name__})
            return None
        self.requests.append({"name": name, "status": resp.status_code,
                              "latency_s": time.perf_counter() - t})
        return resp


async def _ingester(rec: Recorder, base: str, token: str, first_step: int, keys: list[str],
                    steps_per_post: int, deadline: float, drain_deadline: float,
                    seed: int) -> dict[str, int]:
    import httpx

    rng = random.Random(seed)
    sent = {"points": 0, "samples": 0, "posts": 0}
    async with httpx.AsyncClient(base_url=base, timeout=30,
                                 headers={"Authorization": f"Bearer {token}"}) as client:
        await rec.call(client, "POST", "/api/ingest/status/", "POST /api/ingest/status/",
                       json={"status": "running"})
        step = first_step
        while time.monotonic() < deadline:
            now = time.time()
            points = [p for s in range(step, step + steps_per_post) for p in _points(keys, s, now, rng)]
            samples = [x for s in range(step, step + steps_per_post) for x in _samples(s, rng)]
            # As the sink: a batch is retried until it lands (5xx, transport error), so a point is
            # either acknowledged or still pending at the end; a 4xx is a bug and stops this run.
            for path, body, n, kind in (("/api/ingest/metrics/", {"points": points}, len(points), "points"),
                                        ("/api/ingest/trajectories/", {"samples": samples}, len(samples), "samples")):
                backoff = 0.2
                while True:
                    resp = await rec.call(client, "POST", path, "POST " + path, json=body)
                    if resp is not None and resp.status_code < 300:
                        sent[kind] += n
                        break
                    if resp is not None and resp.status_code < 500:
                        raise RuntimeError(f"{path}: {resp.status_code} {resp.text[:300]}")
                    if time.monotonic() > drain_deadline:
                        return sent  # unacknowledged: counted by SQL, reported as lost if absent
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
            sent["posts"] += 1
            step += steps_per_post
    return sent


def ingest_main(base: str, tokens: list[str], first_step: int, keys: list[str], steps_per_post: int,
                duration_s: float, conn) -> None:
    """Child process: every run's ingester, until the deadline; sends back what it observed."""
    async def main():
        rec = Recorder()
        deadline = time.monotonic() + duration_s
        sents = await asyncio.gather(*[
            _ingester(rec, base, tok, first_step, keys, steps_per_post, deadline, deadline + 60, i)
            for i, tok in enumerate(tokens)])
        return rec.requests, sents
    requests, sents = asyncio.run(main())
    conn.send({"requests": requests, "sent": sents, "cpu_s": time.process_time()})
    conn.close()


async def _login(base: str, username: str, password: str) -> dict[str, str]:
    """Log in through the login page; returns the session's cookies. Done before the clock
    starts: a login hashes the password on purpose (PBKDF2), a second of CPU each here."""
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=300, follow_redirects=False) as client:
        return await _login_with(client, base, username, password)


async def _login_with(client, base: str, username: str, password: str) -> dict[str, str]:
    r = await client.get("/accounts/login/")
    r.raise_for_status()
    csrf = client.cookies.get("csrftoken")
    if not csrf:
        raise RuntimeError("the login page set no csrftoken cookie (secure cookies over http?)")
    r = await client.post("/accounts/login/", data={"username": username, "password": password,
                                                    "csrfmiddlewaretoken": csrf},
                          headers={"Referer": base + "/accounts/login/"})
    if r.status_code != 302 or "sessionid" not in client.cookies:
        raise RuntimeError(f"login as {username} failed: {r.status_code}")
    return dict(client.cookies)


async def login_all(base: str, users: list[tuple[str, str]]) -> list[dict[str, str]]:
    sem = asyncio.Semaphore(2)

    async def one(username: str, password: str) -> dict[str, str]:
        async with sem:
            return await _login(base, username, password)
    return await asyncio.gather(*[one(u, p) for u, p in users])


async def _user(rec: Recorder, pages: list[dict[str, Any]], base: str, cookies: dict[str, str],
                api_token: str, run_ids: list[int], run_keys: str, compare_keys: str,
                compare_buckets: int, run_buckets: int, think_s: float, deadline: float,
                seed: int) -> None:
    import httpx

    rng = random.Random(1000 + seed)
    browser = httpx.AsyncClient(base_url=base, timeout=30, cookies=cookies)
    api = httpx.AsyncClient(base_url=base, timeout=30, headers={"Authorization": f"Token {api_token}"})

    async def page(name: str, calls: list[tuple[Any, str, str, dict]]) -> None:
        t = time.perf_counter()
        worst: int | None = 0  # None: a transport error; a page stops at its first failure
        for client, url, label, params in calls:
            resp = await rec.call(client, "GET", url, label, params=params)
            if resp is None:
                worst = None
                break
            worst = max(worst, resp.status_code)
            if resp.status_code >= 400:
                break
        pages.append({"name": name, "status": worst, "latency_s": time.perf_counter() - t})

    try:
        while time.monotonic() < deadline:
            run = rng.choice(run_ids)
            pick = rng.random()
            ids = rng.sample(run_ids, COMPARE_RUNS)
            if pick < 0.35:  # the run page, as charts.js loads it
                await page("run page", [
                    (browser, f"/runs/{run}/", "GET /runs/{id}/", {}),
                    (browser, f"/api/runs/{run}/metrics/", "GET /api/runs/{id}/metrics/",
                     {"keys": run_keys, "buckets": run_buckets, "x": "step"}),
                    (browser, f"/api/runs/{run}/trajectories/", "GET /api/runs/{id}/trajectories/", {}),
                    (browser, f"/api/runs/{run}/", "GET /api/runs/{id}/", {}),
                    (browser, f"/api/runs/{run}/events/", "GET /api/runs/{id}/events/", {})])
            elif pick < 0.60:  # the compare page over 8 live runs
                await page("compare page", [
                    (browser, "/compare/", "GET /compare/", {"ids": ",".join(map(str, ids))}),
                    (browser, "/api/runs/compare/", "GET /api/runs/compare/",
                     {"ids": ",".join(map(str, ids)), "keys": compare_keys,
                      "buckets": compare_buckets, "x": rng.choice(["step", "time"])})])
            elif pick < 0.70:
                await page("run list", [(browser, "/", "GET /", {})])
            else:  # a script on the API
                choice = rng.random()
                if choice < 0.4:
                    await page("api: metrics", [(api, f"/api/runs/{run}/metrics/",
                                                 "GET /api/runs/{id}/metrics/",
                                                 {"keys": "reward/mean,loss", "buckets": 500})])
                elif choice < 0.7:
                    await page("api: compare", [(api, "/api/runs/compare/", "GET /api/runs/compare/",
                                                 {"ids": ",".join(map(str, ids)),
                                                  "keys": "reward/mean,eval/accuracy"})])
                else:
                    await page("api: run list", [(api, "/api/runs/", "GET /api/runs/", {})])
            await asyncio.sleep(rng.uniform(0, 2 * think_s))
    finally:
        await browser.aclose()
        await api.aclose()


def users_main(base: str, users: list[tuple[dict[str, str], str]], run_ids: list[int], run_keys: str,
               compare_keys: str, compare_buckets: int, run_buckets: int, think_s: float,
               duration_s: float, conn) -> None:
    async def main():
        rec, pages = Recorder(), []
        deadline = time.monotonic() + duration_s
        await asyncio.gather(*[
            _user(rec, pages, base, cookies, tok, run_ids, run_keys, compare_keys, compare_buckets,
                  run_buckets, think_s, deadline, i) for i, (cookies, tok) in enumerate(users)])
        return rec.requests, pages
    requests, pages = asyncio.run(main())
    conn.send({"requests": requests, "pages": pages, "cpu_s": time.process_time()})
    conn.close()


# ---- set-up -------------------------------------------------------------------------------------

def fresh_database(url: str) -> None:
    """Drop and create the scratch database: a flush would trip over tables of apps that are
    no longer installed, and a stale database would skew the counts."""
    import psycopg

    base, _, name = url.rpartition("/")
    with psycopg.connect(base + "/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def copy_history(run_ids: list[int], keys: list[str], steps: int) -> int:
    """COPY ``steps`` steps of every key into each run (as if the run had been going for a
    while), then build their rollups; returns the points loaded."""
    from django.db import connection

    from webapp.runs.models import Run
    from webapp.tracking.models import MetricPoint
    from webapp.tracking.services import metric_rollups_rebuild

    rng = random.Random(7)
    total = 0
    t0 = time.time() - steps
    for run_id in run_ids:
        buf = io.StringIO()
        for s in range(steps):
            for p in _points(keys, s, t0 + s, rng):
                buf.write(f"{run_id}\t{p['key']}\t{s}\t{p['value']}\t{p['time']}\n")
                total += 1
        with connection.cursor() as cur, cur.connection.cursor().copy(
                f"COPY {MetricPoint._meta.db_table} (run_id, key, step, value, wall_time) FROM STDIN") as cp:
            cp.write(buf.getvalue())
        metric_rollups_rebuild(run=Run.objects.get(id=run_id))
    # VACUUM as well as ANALYZE: a table just filled by COPY has no visibility map (index-only
    # scans fetch every heap page) and is due an autovacuum, which would then run inside the
    # measured minutes; a tracker that has been up a while has had both.
    from webapp.tracking.models import MetricRollup

    with connection.cursor() as cur:
        for model in (MetricPoint, MetricRollup):
            cur.execute(f"VACUUM (ANALYZE) {model._meta.db_table}")
    return total


def count_stored(run_ids: list[int]) -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM tracking_metricpoint WHERE run_id = ANY(%s)", [run_ids])
        points = cur.fetchone()[0]
        cur.execute("SELECT count(*) FROM tracking_trajectorysample WHERE run_id = ANY(%s)", [run_ids])
        samples = cur.fetchone()[0]
    return {"points": points, "samples": samples}


# ---- CPU accounting: who used the machine during the load (it is shared) ----------------------

def _cpu_s(pid: int, *, reaped: bool = False) -> float:
    """utime + stime of a process in seconds, or with ``reaped`` those of its children that
    exited and were waited for (0 if it is gone)."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.children_user + t.children_system if reaped else t.user + t.system


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def stack_snapshot(server_pids: list[int], ingest_pid: int | None = None) -> dict[str, Any]:
    """CPU seconds so far of the gunicorn masters and workers (``ingest``: those of the ingest
    pool, ``ingest_pid``'s, again on their own) and of the PostgreSQL backends serving this
    database, and the machine's jiffies."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()")
        backends = [r[0] for r in cur.fetchall()]
        cur.execute("SELECT pg_backend_pid()")
        postmaster = psutil.Process(cur.fetchone()[0]).ppid()
    connection.close()
    web = [p for pid in server_pids for p in (pid, *_children(pid))]
    ingest = [ingest_pid, *_children(ingest_pid)] if ingest_pid else []
    # Backends come and go (connections live CONN_MAX_AGE seconds): those that exited are counted
    # through the postmaster's reaped-children time, which a live list alone would miss.
    return {"web": {p: _cpu_s(p) for p in web}, "pg": {p: _cpu_s(p) for p in backends},
            "pg_reaped": _cpu_s(postmaster, reaped=True),
            "ingest": {p: _cpu_s(p) for p in ingest}, "jiffies": _machine_jiffies()}


def cpu_report(before: dict[str, Any], after: dict[str, Any], clients_cpu_s: float,
               wall_s: float) -> dict[str, Any]:
    def used(kind: str) -> float:  # a process gone by the end is missed: say "at least"
        return sum(max(0.0, cpu - before.get(kind, {}).get(pid, 0.0))
                   for pid, cpu in after.get(kind, {}).items())

    busy = after["jiffies"][0] - before["jiffies"][0]
    total = after["jiffies"][1] - before["jiffies"][1]
    cores = os.cpu_count() or 1
    web = used("web")
    pg = used("pg") + max(0.0, after.get("pg_reaped", 0.0) - before.get("pg_reaped", 0.0))
    busy_cores = cores * busy / total if total else 0.0
    return {"cores": cores, "machine_busy_frac": busy / total if total else None,
            "web_workers_cpu_s": web, "ingest_pool_cpu_s": used("ingest"),
            "postgres_backends_cpu_s": pg, "clients_cpu_s": clients_cpu_s,
            "stack_cores": (web + pg) / wall_s, "clients_cores": clients_cpu_s / wall_s,
            "other_cores": max(0.0, busy_cores - (web + pg + clients_cpu_s) / wall_s),
            "load_avg_1m_after": os.getloadavg()[0]}


async def warm_up(base: str, api_token: str, run_ids: list[int], concurrency: int) -> None:
    """Each worker imports its views on its first requests: done before the clock starts."""
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=60,
                                 headers={"Authorization": f"Token {api_token}"}) as api:
        for _ in range(2):
            await asyncio.gather(*[api.get(url, params=params) for url, params in [
                ("/api/runs/", {}), (f"/api/runs/{run_ids[0]}/metrics/", {}),
                ("/api/runs/compare/", {"ids": ",".join(map(str, run_ids[:COMPARE_RUNS]))}),
            ] * concurrency])


def start_server(port: int, env: dict[str, str], workers: int, threads: int, log_path: Path,
                 pool: str = "web", nice: int = 10):
    """``scripts/serve.sh`` for ``pool`` (web: every page and API; ingest: what the proxy sends
    /api/ingest/ to, at CPU priority ``nice``), listening on ``port``."""
    import httpx

    prefix = "OOLONG_WEB" if pool == "web" else "OOLONG_INGEST"
    env = {**env, "OOLONG_WEB_POOL": pool, f"{prefix}_BIND": f"127.0.0.1:{port}",
           f"{prefix}_WORKERS": str(workers), f"{prefix}_THREADS": str(threads),
           "OOLONG_INGEST_NICE": str(nice)}
    log = log_path.open("w")
    # No control socket: its default path is one per user, which a second server would take.
    proc = subprocess.Popen(["bash", "scripts/serve.sh", "--error-logfile", "-", "--no-control-socket"],
                            cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"scripts/serve.sh exited {proc.returncode}: see {log_path}")
        try:
            if httpx.get(base + "/accounts/login/", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer within 120 s: see {log_path}")


def stop_server(proc) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # gunicorn's master stops its workers gracefully
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _receive(conn, proc, give_up: float) -> dict[str, Any]:
    """A client process's results; a process that died (its traceback is on stderr) or hangs
    past ``give_up`` stops the benchmark instead of blocking it."""
    while not conn.poll(1.0):
        if not proc.is_alive() or time.monotonic() > give_up:
            proc.terminate()
            raise RuntimeError(f"client process {proc.name} exited {proc.exitcode} without results")
    return conn.recv()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 s of load, a short history")
    parser.add_argument("--duration-s", type=float, help="seconds of load (default 180, quick 60)")
    parser.add_argument("--runs", type=int, default=32)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--ingesting", type=int, help="runs that ingest (default: all; 0: users alone, "
                                                     "the baseline for what the ingest costs them)")
    parser.add_argument("--steps-per-post", type=int, default=10,
                        help="steps per ingest batch (the sink sends what a flush interval gathered)")
    parser.add_argument("--history-steps", type=int, help="steps per run loaded first (default 2000, quick 200)")
    parser.add_argument("--think-s", type=float, default=0.5, help="users' mean pause between pages")
    parser.add_argument("--workers", type=int, default=0, help="gunicorn workers (default: serve.sh's)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--ingest-workers", type=int, default=0,
                        help="workers of the ingest pool (default: serve.sh's, one per core)")
    parser.add_argument("--ingest-threads", type=int, default=4)
    parser.add_argument("--ingest-nice", type=int, default=10, help="the ingest pool's CPU priority")
    parser.add_argument("--single-pool", action="store_true",
                        help="one pool serves ingest and pages alike (the setup before the split)")
    parser.add_argument("--database-url", help="a scratch database: dropped and created afresh",
                        default=os.environ.get(
        "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/oolong_web_load"))
    parser.add_argument("--redis-url", help="the server's cache and broker",
                        default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/5"))
    parser.add_argument("--out", default="bench-results/web_load.json")
    args = parser.parse_args()
    duration = args.duration_s or (60.0 if args.quick else 180.0)
    history = args.history_steps if args.history_steps is not None else (200 if args.quick else 2000)
    workers = args.workers or 2 * os.cpu_count() + 1
    ingest_workers = args.ingest_workers or os.cpu_count()
    if not args.database_url.startswith("postgres") or "127.0.0.1" not in args.database_url \
            or "127.0.0.1" not in args.redis_url:
        parser.error("--database-url and --redis-url: PostgreSQL and Redis on 127.0.0.1 only")

    fresh_database(args.database_url)
    data_dir = ROOT / ".cache" / "bench-web-load"
    os.environ.update({"DATABASE_URL": args.database_url, "CELERY_BROKER_URL": "memory://",
                       "DJANGO_SETTINGS_MODULE": "webapp.config.settings.local",
                       "OOLONG_DATA_DIR": str(data_dir)})
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connections

    call_command("migrate", verbosity=0)

    from training_core.ports import free_port
    from webapp.accounts.services import (
        membership_add,
        project_create,
        token_get_or_create,
        user_create,
    )
    from webapp.dashboard.charts import (
        COMPARE_BUCKETS,
        COMPARE_CHARTS,
        RUN_BUCKETS,
        RUN_CHART_GROUPS,
    )
    from webapp.datasets.services import dataset_create_builtin
    from webapp.rewards.services import reward_function_create
    from webapp.runs.services import run_create, run_token_issue

    setup_start = time.perf_counter()
    owner = user_create(username="load-owner", password=secrets.token_urlsafe(16))
    project = project_create(user=owner, name="load")
    dv = dataset_create_builtin(project=project, user=owner, name="a", builtin="arithmetic", size=20)
    rv = reward_function_create(project=project, user=owner, name="r", builtin="arithmetic")
    runs = [run_create(project=project, user=owner, name=f"load-{i:02d}", dataset_version=dv,
                       reward_version=rv, spec={"trainer": {"lr": 1e-6 * (i + 1)}})
            for i in range(args.runs)]
    run_ids = [r.id for r in runs]
    tokens = [run_token_issue(run=r, purpose="web_load benchmark") for r in runs]
    users = []
    for i in range(args.users):
        password = secrets.token_urlsafe(16)
        u = user_create(username=f"load-user-{i:02d}", password=password)
        membership_add(project=project, user=u)
        users.append((u.username, password, token_get_or_create(user=u)))
    keys = metric_keys()
    history_points = copy_history(run_ids, keys, history) if history else 0
    setup_s = time.perf_counter() - setup_start
    connections.close_all()  # nothing of the parent's connections crosses the fork

    port = free_port()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "webapp.config.settings.production",
           "DJANGO_SECRET_KEY": secrets.token_urlsafe(50), "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
           "CELERY_BROKER_URL": args.redis_url, "DJANGO_CACHE_URL": args.redis_url,
           # Plain HTTP on the loopback: a deployment terminates TLS in front of gunicorn.
           "DJANGO_SECURE_COOKIES": "0", "DJANGO_SECURE_SSL_REDIRECT": "0"}
    log_path = data_dir / "gunicorn.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    server, base = start_server(port, env, workers, args.threads, log_path)
    servers, ingest_base = [server], base
    try:
        if not args.single_pool:  # started after the web pool: that one runs the migrations
            ingest_server, ingest_base = start_server(
                free_port(), env, ingest_workers, args.ingest_threads,
                data_dir / "gunicorn-ingest.log", pool="ingest", nice=args.ingest_nice)
            servers.append(ingest_server)
        for b in dict.fromkeys([base, ingest_base]):
            asyncio.run(warm_up(b, users[0][2], run_ids, workers * args.threads // 3 + 1))
        sessions = asyncio.run(login_all(base, [(u, p) for u, p, _ in users]))
        browsers = [(cookies, tok) for cookies, (_, _, tok) in zip(sessions, users, strict=True)]
        run_keys = ",".join(dict.fromkeys(k for _, _, charts in RUN_CHART_GROUPS for _, ks in charts for k in ks))
        compare_keys = ",".join(k for _, ks in COMPARE_CHARTS for k in ks)
        ctx = multiprocessing.get_context("fork")
        ingest_rx, ingest_tx = ctx.Pipe(duplex=False)
        users_rx, users_tx = ctx.Pipe(duplex=False)
        ingest_pid = servers[1].pid if len(servers) > 1 else None
        before = stack_snapshot([s.pid for s in servers], ingest_pid)
        load_start = time.perf_counter()
        ingesting = tokens if args.ingesting is None else tokens[:args.ingesting]
        procs = [ctx.Process(target=ingest_main, args=(ingest_base, ingesting, history, keys, args.steps_per_post,
                                                      duration, ingest_tx), daemon=True),
                 ctx.Process(target=users_main, args=(base, browsers, run_ids, run_keys, compare_keys,
                                                      COMPARE_BUCKETS, RUN_BUCKETS, args.think_s,
                                                      duration, users_tx), daemon=True)]
        for p in procs:
            p.start()
        give_up = time.monotonic() + duration + 300
        ingest = _receive(ingest_rx, procs[0], give_up)
        user_side = _receive(users_rx, procs[1], give_up)
        cpu = cpu_report(before, stack_snapshot([s.pid for s in servers], ingest_pid),
                         ingest["cpu_s"] + user_side["cpu_s"], time.perf_counter() - load_start)
        for p in procs:
            p.join(timeout=30)
        load_s = time.perf_counter() - load_start
    finally:
        for s in servers:
            stop_server(s)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a client process failed: exit codes {[p.exitcode for p in procs]}")

    stored = count_stored(run_ids)
    acked = {"points": sum(s["points"] for s in ingest["sent"]) + history_points,
             "samples": sum(s["samples"] for s in ingest["sent"]),
             "history_points": history_points, "history_samples": 0}
    requests = ingest["requests"] + user_side["requests"]
    config = {"quick": args.quick, "duration_s": duration, "runs": args.runs, "users": args.users,
              "ingesting": len(ingesting),
              "keys_per_step": len(keys), "steps_per_post": args.steps_per_post,
              "samples_per_step": SAMPLES_PER_STEP, "history_steps": history,
              "compare_runs": COMPARE_RUNS, "think_s": args.think_s,
              "server": {"command": "scripts/serve.sh (gunicorn gthread)", "workers": workers,
                         "threads": args.threads, "settings": "webapp.config.settings.production",
                         "ingest_pool": None if args.single_pool else {
                             "command": "OOLONG_WEB_POOL=ingest scripts/serve.sh",
                             "workers": ingest_workers, "threads": args.ingest_threads,
                             "nice": args.ingest_nice},
                         # chart reads shared through the cache (settings.SERIES_CACHE_S)
                         "series_cache_s": float(os.environ.get("OOLONG_SERIES_CACHE_S", "3"))},
              "cpu": cpu,
              "setup_s": setup_s, "load_wall_s": load_s}
    report = build_report(requests=requests, pages=user_side["pages"], duration_s=duration,
                          sent=acked, stored=stored, config=config)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({**{k: report[k] for k in ("errors_5xx", "points_lost", "samples_lost",
                                                "compare_view_p95_ms", "throughput", "aims")},
                      "cpu": cpu}, indent=2))
    for name, e in report["endpoints"].items():
        print(f"{name:40s} n={e['requests']:6d} {e['requests_per_s']:7.1f}/s p50={e['p50_ms'] or 0:7.1f} "
              f"p95={e['p95_ms'] or 0:7.1f} p99={e['p99_ms'] or 0:7.1f} 5xx={e['errors_5xx']}")
    for name, e in report["pages"].items():
        print(f"page {name:35s} n={e['requests']:6d} p50={e['p50_ms'] or 0:7.1f} "
              f"p95={e['p95_ms'] or 0:7.1f} p99={e['p99_ms'] or 0:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
