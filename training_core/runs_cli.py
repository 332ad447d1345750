"""`oolong runs create|list|watch|cancel|resume|compare`: the REST API from a terminal or CI.

Server and credentials come from --url/--token or OOLONG_URL/OOLONG_TOKEN (a user API token;
get one with POST /api/auth/token/ or `manage.py oolong_user`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from training_core.config import _deep_merge, parse_overrides
from training_core.http import WebClient

TERMINAL = {"succeeded", "failed", "cancelled"}


class ApiError(RuntimeError):
    pass


def _client(args: argparse.Namespace) -> httpx.Client:
    url = args.url or os.environ.get("OOLONG_URL", "http://127.0.0.1:8000")
    token = args.token or os.environ.get("OOLONG_TOKEN")
    if not token:
        raise ApiError("no API token: pass --token or set OOLONG_TOKEN")
    return WebClient.for_user(url, token, timeout_s=60).http


def _check(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        try:
            body = resp.json()
            lines = [f"  {e.get('field') or '-'}: {e['message']}" for e in body.get("errors", [])]
            raise ApiError(f"{resp.status_code}: {body.get('message')}\n" + "\n".join(lines))
        except ValueError:
            raise ApiError(f"{resp.status_code}: {resp.text[:300]}") from None
    return resp.json()


def cmd_create(args: argparse.Namespace) -> int:
    spec: dict[str, Any] = {}
    if args.config:
        spec = yaml.safe_load(open(args.config)) or {}
    spec = _deep_merge(spec, parse_overrides(args.overrides))
    with _client(args) as http:
        run = _check(http.post("/api/runs/", json={
            "project": args.project, "name": args.name or spec.get("name", "run"),
            "dataset_version": args.dataset_version, "reward_version": args.reward_version,
            "spec": spec}))
    print(f"created run {run['id']} ({run['status']})")
    if args.watch:
        args.run_id = run["id"]
        return cmd_watch(args)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    params = {k: v for k, v in {"status": args.status, "project": args.project}.items() if v}
    with _client(args) as http:
        page = _check(http.get("/api/runs/", params={**params, "limit": args.limit}))
    print(f"{'id':>5}  {'status':<12} {'name':<30} created")
    for r in page["results"]:
        print(f"{r['id']:>5}  {r['status']:<12} {r['name'][:30]:<30} {r['created_at'][:19]}")
    return 0


def watch_run(http: httpx.Client, run_id: int, *, interval: float = 2.0) -> dict:
    """A progress bar read from the tracker until the run ends; its events print above it."""
    run = _check(http.get(f"/api/runs/{run_id}/"))
    bar = tqdm(total=run["spec"]["trainer"]["steps"], desc=f"run {run['id']} {run['name']}",
               unit="step", dynamic_ncols=True)
    last_event = 0
    while True:
        for e in _check(http.get(f"/api/runs/{run_id}/events/", params={"after": last_event})):
            last_event = e["id"]
            if e["kind"] != "trainer_log":
                bar.write(f"    [{e['time'][11:19]}] {e['kind']}: {e['message'].splitlines()[0][:120]}")
        run = _check(http.get(f"/api/runs/{run_id}/"))
        m = run["latest_metrics"]
        bar.update(max(0, int(m.get("version", 0)) - bar.n))
        bar.set_postfix(status=run["status"], reward=f"{m.get('reward/mean', float('nan')):.3f}",
                        eval_acc=f"{m.get('eval/accuracy', float('nan')):.2f}",
                        stale=f"{m.get('staleness/mean', float('nan')):.2f}")
        if run["status"] in TERMINAL:
            bar.close()
            return run
        time.sleep(interval)


def cmd_watch(args: argparse.Namespace) -> int:
    with _client(args) as http:
        run = watch_run(http, args.run_id, interval=args.interval)
    print(f"run {run['id']}: {run['status']}" + (f" ({run['status_reason']})" if run["status_reason"] else ""))
    return 0 if run["status"] == "succeeded" else 1


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as http:
        run = _check(http.post(f"/api/runs/{args.run_id}/cancel/"))
    print(f"run {run['id']}: {run['status']} (cancel requested)")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with _client(args) as http:
        run = _check(http.post(f"/api/runs/{args.run_id}/resume/"))
    print(f"run {run['id']}: {run['status']} (resuming from the latest checkpoint)")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    with _client(args) as http:
        body = _check(http.get("/api/runs/compare/", params={"ids": ",".join(map(str, args.run_ids)),
                                                             "keys": ",".join(args.keys)}))
    names = [f"#{r['id']} {r['name']}"[:24] for r in body["runs"]]
    print(f"{'':<34}" + "".join(f"{n:<26}" for n in names))
    for key in args.keys:
        vals = [body["latest"].get(str(r["id"]), {}).get(key) for r in body["runs"]]
        print(f"{key:<34}" + "".join(f"{'-' if v is None else f'{v:.4f}':<26}" for v in vals))
    print("\nconfig differences:")
    for row in body["config_diff"]:
        if row["differs"]:
            print(f"  {row['key']:<32}" + "".join(f"{str(v)[:24]:<26}" for v in row["values"]))
    return 0


def add_runs_parser(sub: argparse._SubParsersAction) -> None:
    runs = sub.add_parser("runs", help="manage runs on an Oolong server (REST API)")
    runs.add_argument("--url", help="server URL (OOLONG_URL)")
    runs.add_argument("--token", help="API token (OOLONG_TOKEN)")
    rs = runs.add_subparsers(dest="runs_command", required=True)
    c = rs.add_parser("create", help="create a run from a YAML spec")
    c.add_argument("--project", type=int, required=True)
    c.add_argument("--dataset-version", type=int, required=True)
    c.add_argument("--reward-version", type=int, required=True)
    c.add_argument("--name")
    c.add_argument("--config", help="run spec YAML")
    c.add_argument("--watch", action="store_true", help="follow it until it ends")
    c.add_argument("--interval", type=float, default=2.0)
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=cmd_create)
    ls = rs.add_parser("list")
    ls.add_argument("--status")
    ls.add_argument("--project", type=int)
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(fn=cmd_list)
    w = rs.add_parser("watch", help="live progress bar until the run ends")
    w.add_argument("run_id", type=int)
    w.add_argument("--interval", type=float, default=2.0)
    w.set_defaults(fn=cmd_watch)
    x = rs.add_parser("cancel")
    x.add_argument("run_id", type=int)
    x.set_defaults(fn=cmd_cancel)
    r = rs.add_parser("resume", help="start a failed or cancelled run again from its checkpoint")
    r.add_argument("run_id", type=int)
    r.set_defaults(fn=cmd_resume)
    cmp_ = rs.add_parser("compare")
    cmp_.add_argument("run_ids", type=int, nargs="+")
    cmp_.add_argument("--keys", nargs="+", default=["reward/mean", "eval/accuracy", "staleness/mean"])
    cmp_.set_defaults(fn=cmd_compare)


def run_command(fn, args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except (ApiError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
