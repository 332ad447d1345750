"""`oolong models export|list|show|alias|download`: the web app's model registry from a
terminal (the server and token as for `oolong runs`: --url/--token or OOLONG_URL/OOLONG_TOKEN).

A model is named by its id, or by an alias with ``--project`` (``oolong models download
production --project 1 --out models/prod``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
import time
from pathlib import Path

from training_core.runs_cli import Api, ApiError, _client, _error_message, _server_parser

FINISHED = {"ready", "failed"}


def _model_id(http: Api, args: argparse.Namespace) -> int:
    if args.model.isdigit():
        return int(args.model)
    if args.project is None:
        raise ApiError(f"model {args.model!r}: an id, or an alias with --project")
    page = http.get("/api/models/", params={"project": args.project, "alias": args.model})
    if not page["results"]:
        raise ApiError(f"project {args.project} has no alias {args.model!r}")
    return page["results"][0]["id"]


def _line(m: dict) -> str:
    acc = m["evaluation"].get("eval/accuracy")
    return (f"{m['id']:>5}  {m['name'][:28]:<28} run {m['run_id']:<5} "
            f"v{m['version'] if m['version'] is not None else '?':<6} {m['status']:<8} "
            f"{'' if acc is None else f'{acc:.1%}':>6}  {','.join(m['aliases'])}")


def cmd_export(args: argparse.Namespace) -> int:
    with _client(args) as http:
        body = {"version": args.version, **({"name": args.name} if args.name else {})}
        m = http.post(f"/api/runs/{args.run_id}/export/", json=body)
        print(f"model version {m['id']}: export of {args.version} queued")
        while args.wait and m["status"] not in FINISHED:
            time.sleep(args.interval)
            m = http.get(f"/api/models/{m['id']}/")
    if args.wait:
        print(_line(m) if m["status"] == "ready" else f"failed: {m['error']}")
        return 0 if m["status"] == "ready" else 1
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("project", args.project), ("run", args.run), ("name", args.name),
                                ("limit", args.limit)) if v is not None}
    with _client(args) as http:
        page = http.get("/api/models/", params=params)
    print(f"{'id':>5}  {'name':<28} {'run':<9} {'version':<7} {'status':<8} {'eval':>6}  aliases")
    for m in page["results"]:
        print(_line(m))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _client(args) as http:
        m = http.get(f"/api/models/{_model_id(http, args)}/")
    lineage = m.pop("lineage") or {}
    print(json.dumps({**m, "lineage": {k: v for k, v in lineage.items() if k != "spec"}},
                     indent=2, default=str))
    return 0


def cmd_alias(args: argparse.Namespace) -> int:
    with _client(args) as http:
        m = http.post(f"/api/models/{args.model_id}/aliases/", json={"alias": args.alias})
    print(f"{args.alias} -> model version {m['id']} ({m['name']} v{m['version']})")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    """Stream the archive to disk (never into memory); ``--out X.tar`` keeps it, any other
    ``--out`` is a new folder it is unpacked into (tar's ``data`` filter: no links out, no
    devices)."""
    out = Path(args.out)
    if out.exists() and (out.suffix == ".tar" or any(out.iterdir())):
        raise ApiError(f"--out {out}: already exists; choose a new path")
    with _client(args) as http:
        mid = _model_id(http, args)
        archive = out if out.suffix == ".tar" else out.with_name(f".{out.name}.download.tar")
        with http.web.http.stream("GET", f"/api/models/{mid}/download/") as resp:
            if resp.status_code >= 400:
                resp.read()
                raise ApiError(_error_message(resp))
            with archive.open("wb") as fh:
                for chunk in resp.iter_bytes():
                    fh.write(chunk)
    if archive != out:
        staging = out.with_name(f".{out.name}.unpack")
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(staging, filter="data")
            (top,) = list(staging.iterdir())  # the archive holds one folder, <name>-v<version>
            top.rename(out)
        finally:
            archive.unlink(missing_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
    print(f"model version {mid} -> {out}")
    return 0


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    ms = _server_parser(sub, "models", "exported model versions in the web app's registry")
    e = ms.add_parser("export", help="export a run's version into the registry (a worker job)")
    e.add_argument("run_id", type=int)
    e.add_argument("--version", default="latest", help="a version number, 'latest' or 'best'")
    e.add_argument("--name", help="the registered model's name (default: the run's)")
    e.add_argument("--wait", action="store_true", help="until the export is ready or failed")
    e.add_argument("--interval", type=float, default=2.0)
    e.set_defaults(fn=cmd_export)
    ls = ms.add_parser("list")
    ls.add_argument("--project", type=int)
    ls.add_argument("--run", type=int)
    ls.add_argument("--name")
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(fn=cmd_list)
    for name, fn, help_ in (("show", cmd_show, "a version's lineage and evaluation"),
                            ("download", cmd_download, "the exported folder (or --out X.tar)")):
        p = ms.add_parser(name, help=help_)
        p.add_argument("model", help="a model version id, or an alias with --project")
        p.add_argument("--project", type=int)
        if name == "download":
            p.add_argument("--out", required=True, help="a new folder, or a file ending in .tar")
        p.set_defaults(fn=fn)
    a = ms.add_parser("alias", help="point an alias (production, best, ...) at a model version")
    a.add_argument("model_id", type=int)
    a.add_argument("alias")
    a.set_defaults(fn=cmd_alias)
