"""The real stack: PostgreSQL (the test database), a Celery worker on Redis in its own process,
Prefect's engine (flows in local mode), embedded rollout servers and the DeepSpeed trainer, with
the web app served by pytest-django's live server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REDIS = os.environ.get("OOLONG_TEST_REDIS", "redis://127.0.0.1:6379/7")

SMALL_SPEC = {
    "model": {"path": "tiny"},
    "rollout": {"group_size": 2, "max_new_tokens": 6, "max_concurrent": 8},
    "trainer": {"batch_groups": 2, "steps": 4, "lr": 1e-3},
    "eval": {"every": 0}, "checkpoint": {"every": 0},
}


def run_processes(run_id: int) -> list[int]:
    """Pids of every live process carrying OOLONG_RUN_ID=<run_id> in its environment."""
    marker = f"OOLONG_RUN_ID={run_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().split()[2]
                if state != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} state {stat[0]} parent {stat[1]}: {cmd[:160]}"


def wait_for_exit(run_id: int, timeout_s: float, what: str = "every process of the run to exit"):
    """Until no process of the run is left; a timeout names the ones that stayed, so a slow
    teardown says which process (a trainer, a server, a flow run) did not stop."""
    deadline = time.monotonic() + timeout_s
    while (left := run_processes(run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; still "
                             "running:\n" + "\n".join(_describe(pid) for pid in left))


def wait_for(predicate, timeout_s: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _use_broker(app, url: str, backend: str) -> None:
    """Unit tests enqueue into the in-memory broker (test settings); forget the app's cached pool
    and producers so the web side's sends reach Redis, where the real worker listens (and back).
    The pools themselves stay open: kombu keeps them in a registry keyed by URL and reuses them."""
    app.conf.broker_url = url
    app.conf.result_backend = backend
    app.conf.task_always_eager = False
    app._pool = None
    app.amqp._producer_pool = None
    vars(app._local).pop("backend", None)


@pytest.fixture
def stack(live_server, settings, tmp_path, transactional_db):
    """Point the web app at Celery on Redis and start a real worker against the test database."""
    from django.db import connection

    from tests.integration.proxy import FlakyProxy
    from workers.celery_app import app

    # Flows and trainers reach the web app through a proxy a test can take down.
    proxy = FlakyProxy(int(live_server.url.rsplit(":", 1)[1]))

    # The worker uses the same Redis as the web side (CELERY_BROKER_URL under `make test`).
    broker = app.conf.broker_url if str(app.conf.broker_url).startswith("redis://") else REDIS
    memory = (app.conf.broker_url, app.conf.result_backend)
    _use_broker(app, broker, broker)
    settings.OOLONG_PUBLIC_URL = proxy.url
    db = connection.settings_dict
    runs_dir = tmp_path / "runs"
    env = {**os.environ,
           "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
           "DJANGO_SETTINGS_MODULE": "webapp.config.settings.local",
           "CELERY_BROKER_URL": broker, "CELERY_RESULT_BACKEND": broker,
           "OOLONG_PUBLIC_URL": proxy.url, "OOLONG_RUNS_DIR": str(runs_dir),
           "OOLONG_PREFECT_MODE": "local", "OMP_NUM_THREADS": "1",
           # Cloud nodes through the stand-in terraform (it hands out this machine as the node).
           "OOLONG_TERRAFORM_BIN": str(ROOT / "tests" / "orchestration" / "fake_terraform.py"),
           "OOLONG_TERRAFORM_WORKSPACES": str(tmp_path / "terraform"),
           "OOLONG_TERRAFORM_SKIP_CREDENTIAL_CHECK": "1", "OOLONG_FAKE_TF_LOG": str(tmp_path / "tf-calls.jsonl"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "platform")])}
    subprocess.run(["redis-cli", "-u", broker, "flushdb"], capture_output=True)
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-P", "solo",
         "--without-heartbeat", "--without-gossip", "--without-mingle", "--loglevel", "INFO"],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: "ready" in log.read_text(), 60, "the Celery worker")
    yield {"url": live_server.url, "proxy": proxy, "broker": broker,
           "tf_log": tmp_path / "tf-calls.jsonl", "runs_dir": runs_dir, "worker": worker,
           "worker_log": log, "env": env}
    proxy.down()
    _use_broker(app, *memory)
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)


@pytest.fixture
def project_setup(db):
    from tests.webapp.conftest import QA_ROWS, client_for, jsonl
    from webapp.accounts.services import project_create, user_create
    from webapp.datasets.services import dataset_upload
    from webapp.rewards.services import reward_function_create

    user = user_create(username="carol", password="carol-pass-123")
    project = project_create(user=user, name="Integration")
    dv = dataset_upload(project=project, user=user, name="adds", task="arithmetic",
                        filename="adds.jsonl", data=jsonl(QA_ROWS * 4))
    rv = reward_function_create(project=project, user=user, name="digits",
                                builtin="arithmetic")
    return {"user": user, "project": project, "dataset_version": dv, "reward_version": rv,
            "api": client_for(user)}


@pytest.fixture
def admin(project_setup):
    """Placement across nodes is infrastructure: the run's creator is an administrator."""
    project_setup["user"].is_staff = True
    project_setup["user"].save()
    return project_setup


def create_run(setup, name: str, **spec_overrides) -> int:
    import copy

    spec = copy.deepcopy(SMALL_SPEC)
    for section, values in spec_overrides.items():
        spec.setdefault(section, {}).update(values)
    resp = setup["api"].post("/api/runs/", {
        "project": setup["project"].id, "name": name, "dataset_version": setup["dataset_version"].id,
        "reward_version": setup["reward_version"].id, "spec": spec}, format="json")
    assert resp.status_code == 201, resp.json()
    return resp.json()["id"]


def run_status(run_id: int) -> str:
    from webapp.runs.models import Run

    return Run.objects.get(id=run_id).status
