"""`oolong runs create|list|watch|cancel|resume|compare` and `oolong sweeps
create|list|show|compare`: the REST API from a terminal or CI.

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
from tqdm import tqdm

from training_core import metric_names as M
from training_core.config import SpecError, parse_scalar, spec_data
from training_core.transport.http import WebClient

TERMINAL = {"succeeded", "failed", "cancelled"}


class ApiError(RuntimeError):
    pass


class Api:
    """The server's REST API as the CLI calls it, over the web app's client (training_core.transport.http):
    reads are retried by the shared policy (connection errors, 5xx), writes are sent once; an
    error answer raises :class:`ApiError` with the server's message and each field's reason."""

    def __init__(self, web: WebClient):
        self.web = web

    def get(self, path: str, **kw: Any) -> Any:
        return self._call("GET", path, retry=True, **kw)

    def post(self, path: str, **kw: Any) -> Any:
        return self._call("POST", path, retry=False, **kw)

    def _call(self, method: str, path: str, *, retry: bool, **kw: Any) -> Any:
        try:
            resp = self.web.request(method, path, retry=retry, **kw)
        except httpx.HTTPStatusError as exc:
            raise ApiError(_error_message(exc.response)) from None
        return resp.json() if resp.content else {}

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self.web.close()


def _client(args: argparse.Namespace) -> Api:
    url = args.url or os.environ.get("OOLONG_URL", "http://127.0.0.1:8000")
    token = args.token or os.environ.get("OOLONG_TOKEN")
    if not token:
        raise ApiError("no API token: pass --token or set OOLONG_TOKEN")
    return Api(WebClient.for_user(url, token, timeout_s=60))


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        lines = [f"  {e.get('field') or '-'}: {e['message']}" for e in body.get("errors", [])]
        return f"{resp.status_code}: {body.get('message')}\n" + "\n".join(lines)
    except (ValueError, AttributeError, KeyError, TypeError):
        return f"{resp.status_code}: {resp.text[:300]}"


def cmd_create(args: argparse.Namespace) -> int:
    spec = spec_data(args.config, args.overrides)
    with _client(args) as http:
        run = http.post("/api/runs/", json={
            "project": args.project, "name": args.name or spec.get("name", "run"),
            "dataset_version": args.dataset_version, "reward_version": args.reward_version,
            "spec": spec, "eval_set_versions": args.eval_set_versions or []})
    print(f"created run {run['id']} ({run['status']})")
    if args.watch:
        args.run_id = run["id"]
        return cmd_watch(args)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    params = {k: v for k, v in {"status": args.status, "project": args.project}.items() if v}
    with _client(args) as http:
        page = http.get("/api/runs/", params={**params, "limit": args.limit})
    print(f"{'id':>5}  {'status':<12} {'name':<30} created")
    for r in page["results"]:
        print(f"{r['id']:>5}  {r['status']:<12} {r['name'][:30]:<30} {r['created_at'][:19]}")
    return 0


def watch_run(http: Api, run_id: int, *, interval: float = 2.0) -> dict:
    """A progress bar read from the tracker until the run ends; its events print above it."""
    run = http.get(f"/api/runs/{run_id}/")
    bar = tqdm(total=run["spec"]["trainer"]["steps"], desc=f"run {run['id']} {run['name']}",
               unit="step", dynamic_ncols=True)
    last_event = 0
    while True:
        for e in http.get(f"/api/runs/{run_id}/events/", params={"after": last_event}):
            last_event = e["id"]
            if e["kind"] != "trainer_log":
                bar.write(f"    [{e['time'][11:19]}] {e['kind']}: {e['message'].splitlines()[0][:120]}")
        run = http.get(f"/api/runs/{run_id}/")
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
        run = http.post(f"/api/runs/{args.run_id}/cancel/")
    print(f"run {run['id']}: {run['status']} (cancel requested)")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with _client(args) as http:
        run = http.post(f"/api/runs/{args.run_id}/resume/")
    print(f"run {run['id']}: {run['status']} (resuming from the latest checkpoint)")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    with _client(args) as http:
        body = http.get("/api/runs/compare/", params={"ids": ",".join(map(str, args.run_ids)),
                                                             "keys": ",".join(args.keys)})
    names = [f"#{r['id']} {r['name']}"[:24] for r in body["runs"]]
    print(f"{'':<34}" + "".join(f"{n:<26}" for n in names))
    for key in args.keys:
        vals = [body["latest"].get(str(r["id"]), {}).get(key) for r in body["runs"]]
        print(f"{key:<34}" + "".join(f"{'-' if v is None else f'{v:.4f}':<26}" for v in vals))
    print()
    print_summary(body)
    return 0


def _axes(vary: list[str]) -> list[dict[str, Any]]:
    """``["rollout.max_staleness=0,1,2"]`` -> ``[{"field": ..., "values": [0, 1, 2]}]``."""
    axes = []
    for item in vary:
        field, sep, raw = item.partition("=")
        if not sep or not field.strip() or not raw.strip():
            raise ApiError(f"--vary {item!r}: write it as field=value,value (e.g. "
                           "rollout.max_staleness=0,1,2,4)")
        axes.append({"field": field.strip(),
                     "values": [parse_scalar(v) for v in raw.split(",") if v.strip()]})
    return axes


def cmd_sweep_create(args: argparse.Namespace) -> int:
    axes = _axes(args.vary)
    with _client(args) as http:
        if args.from_run:
            body: dict[str, Any] = {"axes": axes, **({"name": args.name} if args.name else {})}
            sweep = http.post(f"/api/runs/{args.from_run}/sweep/", json=body)
        else:
            missing = [f"--{n.replace('_', '-')}" for n in ("project", "dataset_version", "reward_version")
                       if getattr(args, n) is None]
            if missing:
                raise ApiError(f"give {', '.join(missing)} (or --from-run RUN_ID)")
            spec = spec_data(args.config, args.overrides)
            sweep = http.post("/api/sweeps/", json={
                "project": args.project, "name": args.name or spec.get("name", "sweep"),
                "dataset_version": args.dataset_version, "reward_version": args.reward_version,
                "spec": spec, "axes": axes, "share_warm_start": not args.separate_warm_starts})
    print(f"created sweep {sweep['id']} ({len(sweep['runs'])} runs):")
    for run in sweep["runs"]:
        print(f"  run {run['id']:>5}  {run['name']}")
    return 0


def cmd_sweep_list(args: argparse.Namespace) -> int:
    params = {"project": args.project} if args.project else {}
    with _client(args) as http:
        page = http.get("/api/sweeps/", params={**params, "limit": args.limit})
    print(f"{'id':>5}  {'name':<30} varies")
    for s in page["results"]:
        varies = "; ".join(f"{a['field']}={','.join(map(str, a['values']))}" for a in s["axes"])
        print(f"{s['id']:>5}  {s['name'][:30]:<30} {varies}")
    return 0


def cmd_sweep_show(args: argparse.Namespace) -> int:
    with _client(args) as http:
        sweep = http.get(f"/api/sweeps/{args.sweep_id}/")
    fields = [a["field"] for a in sweep["axes"]]
    print(f"sweep {sweep['id']} {sweep['name']}")
    print(f"{'run':>5}  {'status':<12} " + "".join(f"{f:<26}" for f in fields))
    for run in sweep["runs"]:
        print(f"{run['id']:>5}  {run['status']:<12} "
              + "".join(f"{str(run['sweep_values'].get(f)):<26}" for f in fields))
    return 0


def _cell(value: Any, kind: str = "n") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "s":
        return f"{value:.1f}s"
    if kind == "int":
        return f"{value:,.0f}"
    return f"{value:.3f}"


def print_summary(body: dict) -> None:
    """The comparison's summary table and the fields that differ."""
    summary = body["summary"]
    target = summary["target"]
    print(f"{'run':<30} {'status':<10} {'steps':>6} {'wall':>8} {'reward':>7} {'eval':>6} "
          f"{'best eval':>9} {'to ' + _cell(target):>10} {'tok/s':>8}")
    for r in summary["rows"]:
        print(f"{r['name'][:30]:<30} {r['status']:<10} {_cell(r['steps'], 'int'):>6} "
              f"{_cell(r['wall_s'], 's'):>8} {_cell(r['final_reward']):>7} "
              f"{_cell(r['final_eval'], 'pct'):>6} {_cell(r['best_eval'], 'pct'):>9} "
              f"{_cell(r['time_to_target_s'], 's'):>10} {_cell(r['tokens_per_s'], 'int'):>8}")
    print("\nconfig differences:")
    for row in body["config_diff"]:
        if row["differs"]:
            print(f"  {row['key']:<32}" + "".join(f"{str(v)[:24]:<26}" for v in row["values"]))


def cmd_sweep_compare(args: argparse.Namespace) -> int:
    params = {"target": args.target} if args.target is not None else {}
    with _client(args) as http:
        body = http.get(f"/api/sweeps/{args.sweep_id}/compare/", params=params)
    print(f"sweep {body['sweep']['id']} {body['sweep']['name']}")
    print_summary(body)
    return 0


def _server_parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse._SubParsersAction:
    """``oolong <name>`` with the server options; returns its subcommands."""
    parser = sub.add_parser(name, help=help)
    parser.add_argument("--url", help="server URL (OOLONG_URL)")
    parser.add_argument("--token", help="API token (OOLONG_TOKEN)")
    return parser.add_subparsers(dest=f"{name}_command", required=True)


def add_sweeps_parser(sub: argparse._SubParsersAction) -> None:
    ss = _server_parser(sub, "sweeps", "groups of runs that differ in one or two fields")
    c = ss.add_parser("create", help="one run per combination of the --vary values, launched together")
    c.add_argument("--vary", action="append", required=True, metavar="FIELD=V1,V2,...",
                   help="a field to vary and its values; once or twice")
    c.add_argument("--from-run", type=int, help="start from this run's dataset, reward and spec")
    c.add_argument("--project", type=int)
    c.add_argument("--dataset-version", type=int)
    c.add_argument("--reward-version", type=int)
    c.add_argument("--name")
    c.add_argument("--config", help="the shared run spec (YAML)")
    c.add_argument("--separate-warm-starts", action="store_true",
                   help="each run makes its own warm start (default: one shared)")
    c.add_argument("overrides", nargs="*", help="shared spec overrides, section.key=value")
    c.set_defaults(fn=cmd_sweep_create)
    ls = ss.add_parser("list")
    ls.add_argument("--project", type=int)
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(fn=cmd_sweep_list)
    sh = ss.add_parser("show", help="the sweep's runs, their values and statuses")
    sh.add_argument("sweep_id", type=int)
    sh.set_defaults(fn=cmd_sweep_show)
    cmp_ = ss.add_parser("compare", help="final and best eval, time to a target reward, tokens/s")
    cmp_.add_argument("sweep_id", type=int)
    cmp_.add_argument("--target", type=float, help="reward to time (default: 90%% of the best)")
    cmp_.set_defaults(fn=cmd_sweep_compare)


def add_runs_parser(sub: argparse._SubParsersAction) -> None:
    rs = _server_parser(sub, "runs", "manage runs on an Oolong server (REST API)")
    c = rs.add_parser("create", help="create a run from a YAML spec")
    c.add_argument("--project", type=int, required=True)
    c.add_argument("--dataset-version", type=int, required=True)
    c.add_argument("--reward-version", type=int, required=True)
    c.add_argument("--eval-set-version", type=int, action="append", dest="eval_set_versions",
                   metavar="ID", help="a dataset version marked as an eval set, evaluated beside "
                                      "the held-out rows and kept out of training; repeat for "
                                      "more (at most 8)")
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
    cmp_.add_argument("--keys", nargs="+",
                      default=[M.REWARD_MEAN, M.EVAL_ACCURACY, M.STALENESS_MEAN])
    cmp_.set_defaults(fn=cmd_compare)


def run_command(fn, args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except (ApiError, SpecError, httpx.HTTPError) as exc:  # a bad spec file is named, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
