"""`make demo`: a real asynchronous RL run on this CPU, visible live in the dashboard.

Embedded defaults only (no PostgreSQL, Redis or Prefect server needed):
1. the web app on SQLite (migrated, a `demo` user with password `demo`),
2. through the REST API: the built-in arithmetic dataset, the arithmetic reward and a run with
   configs/demo.yaml as its spec,
3. the trainer side, as a node would: it fetches spec and data with the run's ingest token,
   warm-starts the tiny model briefly, then runs asynchronous GRPO (embedded rollout server
   process + DeepSpeed trainer) and streams metrics to the tracker.

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
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training_core.launch import free_port  # noqa: E402


def sh(*args: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, **kw)


def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer in {timeout_s:.0f}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("OOLONG_PORT", 8000)))
    parser.add_argument("--warm-start-seconds", type=float, default=45)
    parser.add_argument("--exit", action="store_true", help="stop the web app when training ends")
    parser.add_argument("overrides", nargs="*", help="spec overrides, e.g. trainer.steps=50")
    args = parser.parse_args()

    data_dir = ROOT / ".cache" / "demo"
    env = {**os.environ, "OOLONG_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1",
           "DJANGO_SETTINGS_MODULE": "webapp.config.settings.local", "TOKENIZERS_PARALLELISM": "false",
           # Until the orchestration path lands, the demo drives the trainer itself.
           "OOLONG_RUN_SUBMISSION": "none"}
    env.pop("DATABASE_URL", None)  # the demo is the embedded default: SQLite
    port = args.port
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
        port = free_port()  # something already listens there
    except httpx.TransportError:
        pass
    base = f"http://127.0.0.1:{port}"

    print("1/4 web app: migrating SQLite and creating the demo user", flush=True)
    sh("manage.py", "migrate", "--verbosity", "0", env=env)
    token, project_id = sh("manage.py", "oolong_user", "demo", "demo", env=env, capture_output=True,
                           text=True).stdout.split()
    web = subprocess.Popen([sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
                           cwd=ROOT, env=env, stdout=(data_dir / "web.log").open("w"),
                           stderr=subprocess.STDOUT)
    try:
        wait_http(base + "/accounts/login/")
        api = httpx.Client(base_url=base, headers={"Authorization": f"Token {token}"}, timeout=120)

        print("2/4 REST API: dataset, reward function and run", flush=True)
        ds = api.post("/api/datasets/builtin/", json={"project": int(project_id), "name": "arithmetic",
                                                      "builtin": "arithmetic", "size": 5000})
        ds.raise_for_status()
        rw = api.post("/api/rewards/", json={"project": int(project_id), "name": "arithmetic",
                                             "builtin": "arithmetic"})
        rw.raise_for_status()
        spec = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
        for item in args.overrides:
            key, value = item.split("=", 1)
            node = spec
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = yaml.safe_load(value)
        run = api.post("/api/runs/", json={"project": int(project_id), "name": f"demo {time.strftime('%H:%M')}",
                                           "dataset_version": ds.json()["id"],
                                           "reward_version": rw.json()["id"], "spec": spec})
        if run.status_code != 201:
            print(run.json()["message"], file=sys.stderr)
            return 2
        run = run.json()
        url = f"{base}/runs/{run['id']}/"
        print(f"\n    Dashboard: {url}   (log in as demo / demo)\n", flush=True)

        from training_core.remote_run import prepare_remote_run

        run_dir = ROOT / "runs" / f"demo-{run['id']}-{time.strftime('%Y%m%d-%H%M%S')}"
        _, spec_path = prepare_remote_run(base, run["ingest_token"], run_dir)
        print(f"3/4 warm start ({args.warm_start_seconds:.0f} s): the tiny model learns the answer format",
              flush=True)
        sh("-m", "training_core.cli", "sft", "--config", str(spec_path), "--out",
           str(run_dir / "initial_model"), "--steps", "100000", "--seconds", str(args.warm_start_seconds),
           env=env)
        print("4/4 asynchronous GRPO (rollout server process + DeepSpeed trainer)", flush=True)
        sh("-m", "training_core.cli", "train", "--config", str(spec_path), env=env)
        print(f"\nDone. Dashboard: {url}  (demo / demo)")
        if not args.exit and sys.stdin.isatty():
            print("The web app keeps running; Ctrl-C to stop.")
            web.wait()
    except KeyboardInterrupt:
        pass
    finally:
        web.terminate()
        web.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
