"""`make demo`: a real asynchronous RL run on this CPU, visible live in the dashboard.

Embedded defaults only (no PostgreSQL, Redis or Prefect server needed):
1. the web app on SQLite (migrated, a `demo` user with password `oolong-demo`),
2. through the REST API: the built-in arithmetic dataset, the arithmetic reward and a run with
   configs/demo.yaml as its spec,
3. a Celery worker (local SQLite broker) submits the run to the `training-run` Prefect flow
   (Prefect's ephemeral engine, no server), which warm-starts the tiny model briefly, starts the
   embedded rollout server and the DeepSpeed trainer, supervises them and tears them down; the
   trainer streams metrics to the tracker over HTTP.

Open the printed URL while it runs. The web app keeps serving after training until Ctrl-C
(`--exit` to stop right away).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training_core.config import spec_data  # noqa: E402
from training_core.ports import free_port  # noqa: E402
from training_core.runs_cli import Api, ApiError, watch_run  # noqa: E402
from training_core.transport.http import WebClient, wait_healthy  # noqa: E402


def sh(*args: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, **kw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("OOLONG_PORT", 8000)))
    parser.add_argument("--exit", action="store_true", help="stop the web app when training ends")
    parser.add_argument("--data-dir", default=str(ROOT / ".cache" / "demo"),
                        help="SQLite database, broker and media of the demo web app")
    parser.add_argument("overrides", nargs="*", help="spec overrides, e.g. trainer.steps=50")
    args = parser.parse_args()

    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OOLONG_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1",
           "DJANGO_SETTINGS_MODULE": "webapp.config.settings.local", "TOKENIZERS_PARALLELISM": "false",
           "OOLONG_PREFECT_MODE": "local",
           "OOLONG_RUNS_DIR": os.environ.get("OOLONG_RUNS_DIR", str(ROOT / "runs"))}
    # The demo is the embedded default: SQLite, a local broker, Prefect without a server.
    for name in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "PREFECT_API_URL"):
        env.pop(name, None)
    port = args.port
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
        port = free_port()  # something already listens there
    except httpx.TransportError:
        pass
    base = f"http://127.0.0.1:{port}"
    env["OOLONG_PUBLIC_URL"] = base

    print("1/4 web app: migrating SQLite and creating the demo user", flush=True)
    sh("manage.py", "migrate", "--verbosity", "0", env=env)
    # The worker and the web app start together below; their broker's queue must exist first.
    sh("manage.py", "oolong_broker", "--verbosity", "0", env=env)
    token, project_id = sh("manage.py", "oolong_user", "demo", "oolong-demo", env=env, capture_output=True,
                           text=True).stdout.split()
    web = subprocess.Popen([sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
                           cwd=ROOT, env=env, stdout=(data_dir / "web.log").open("w"),
                           stderr=subprocess.STDOUT)
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker",
                               "-P", "solo", "--loglevel", "INFO"], cwd=ROOT, env=env,
                              stdout=(data_dir / "worker.log").open("w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(base + "/accounts/login/", 60, ok=lambda status: status < 500, interval_s=0.3)
        api = Api(WebClient.for_user(base, token, timeout_s=120))

        print("2/4 REST API: dataset, reward function and run", flush=True)
        ds = api.post("/api/datasets/builtin/", json={"project": int(project_id), "name": "arithmetic",
                                                      "builtin": "arithmetic", "size": 5000})
        rw = api.post("/api/rewards/", json={"project": int(project_id), "name": "arithmetic",
                                             "builtin": "arithmetic"})
        spec = spec_data(ROOT / "configs" / "demo.yaml", args.overrides)
        try:
            run = api.post("/api/runs/", json={
                "project": int(project_id), "name": f"demo {time.strftime('%H:%M')}",
                "dataset_version": ds["id"], "reward_version": rw["id"], "spec": spec})
        except ApiError as exc:  # a bad override: the server names the field
            print(exc, file=sys.stderr)
            return 2
        url = f"{base}/runs/{run['id']}/"
        print(f"\n    Dashboard: {url}   (log in as demo / oolong-demo)\n", flush=True)

        print("3/4 Celery -> Prefect flow: warm start, rollout server, DeepSpeed trainer", flush=True)
        final = watch_run(api, run["id"])
        print(f"4/4 run {run['id']} {final['status']}"
              + (f": {final['status_reason']}" if final["status_reason"] else ""), flush=True)
        summary(api, run["id"])
        if final["status"] != "succeeded":
            print(f"logs: {ROOT / 'runs' / 'flows' / ('run-' + str(run['id'])) / 'logs'}", file=sys.stderr)
            return 1
        print(f"\nDone. Dashboard: {url}  (demo / oolong-demo)")
        if not args.exit and sys.stdin.isatty():
            print("The web app keeps running; Ctrl-C to stop.")
            web.wait()
    except KeyboardInterrupt:
        pass
    finally:
        for proc in (worker, web):
            proc.terminate()
            proc.wait(timeout=15)
    return 0


def summary(api: Api, run_id: int) -> None:
    series = {s["key"]: s for s in api.get(f"/api/runs/{run_id}/metrics/", params={
        "keys": "eval/accuracy,reward/mean", "buckets": 5000})["series"]}
    acc, rew = series["eval/accuracy"]["mean"], series["reward/mean"]["mean"]
    if acc:
        print(f"  greedy eval accuracy: {acc[0]:.1%} -> {acc[-1]:.1%}")
    if rew:
        k = max(1, len(rew) // 5)
        print(f"  sampled reward (first/last {k} steps): {sum(rew[:k]) / k:.3f} -> {sum(rew[-k:]) / k:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
