"""Issue 47, item 7: nothing is lost when the broker or a worker dies. Creating a run while the
broker was down answered 500 and left the run ``queued`` forever, outside what reconcile looked
at; a worker killed inside ``run_submit`` acknowledged the message, with the same end.

Real parts: a Redis of the test's own on another port, really stopped and started (never the
shared one), and a real Celery worker whose pool child is killed while it waits on a Prefect API
that never answers (a listener that accepts and stays silent)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.integration.conftest import _use_broker, wait_for
from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    api,
    dataset_version,
    project,
    reward_version,
)
from training_core.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.django_db(transaction=True)


class OwnRedis:
    """A redis-server on a port of its own, for this test only (the shared 6379/6380 are never
    touched)."""

    def __init__(self, tmp: Path):
        self.port, self.tmp = free_port(), tmp
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.tmp)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self.cli("ping") == "PONG", 20, "the test's own redis")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip()

    def queued_runs(self) -> list[int]:
        """Run ids of the oolong.run_submit messages waiting in the default queue."""
        ids = []
        for raw in self.cli("lrange", "celery", "0", "-1").splitlines():
            message = json.loads(raw)
            if message["headers"]["task"] == "oolong.run_submit":
                ids.append(json.loads(message["headers"]["argsrepr"].replace("(", "[").replace(
                    ",)", "]").replace(")", "]"))[0])
        return ids


@pytest.fixture
def own_redis(tmp_path, monkeypatch):
    from workers.celery_app import app

    redis = OwnRedis(tmp_path)
    redis.start()
    memory = (app.conf.broker_url, app.conf.result_backend)
    # Celery reads CELERY_BROKER_URL from the environment before its settings.
    monkeypatch.setenv("CELERY_BROKER_URL", redis.url)
    _use_broker(app, redis.url, "cache+memory://")  # results are not needed here
    app.conf.broker_connection_timeout = 2
    yield redis
    _use_broker(app, *memory)
    redis.stop()


def _create(api, project, dataset_version, reward_version):  # noqa: F811
    return api.post("/api/runs/", {"project": project.id, "name": "o", "spec": {},
                                   "dataset_version": dataset_version.id,
                                   "reward_version": reward_version.id}, format="json")


def _age(run_id: int, seconds: float = 600) -> None:
    """As if the last send was ``seconds`` ago (reconcile sends again after 120 s)."""
    from django.utils import timezone

    from webapp.runs.models import Run

    Run.objects.filter(id=run_id).update(submit_sent_at=timezone.now() - timedelta(seconds=seconds))


def test_a_run_created_while_the_broker_is_down_is_kept_and_sent_again(
        api, project, dataset_version, reward_version, own_redis):  # noqa: F811
    from webapp.runs.models import Run
    from webapp.runs.orchestration import MAX_SUBMIT_ATTEMPTS, runs_reconcile

    own_redis.stop()
    r = _create(api, project, dataset_version, reward_version)
    assert r.status_code == 503, r.content  # was a 500
    body = r.json()
    run = Run.objects.get(id=body["run_id"])
    assert f"run {run.id} was created but could not be queued" in body["message"]
    assert run.status == "queued" and run.orchestrator_ref == "" and run.submit_attempts == 1
    assert "task queue is unreachable" in run.submit_error

    # Not sent again before its time; then sent, once the broker is back.
    own_redis.start()
    assert runs_reconcile() == 0 and own_redis.queued_runs() == []
    _age(run.id)
    assert runs_reconcile() == 1
    assert own_redis.queued_runs() == [run.id]
    run.refresh_from_db()
    assert run.submit_attempts == 2 and run.submit_error == ""

    # Nobody ever takes it (the broker keeps failing): after a few sends it fails, saying why.
    own_redis.stop()
    while run.submit_attempts < MAX_SUBMIT_ATTEMPTS:
        _age(run.id)
        runs_reconcile()
        run.refresh_from_db()
    assert run.status == "queued"
    _age(run.id)
    assert runs_reconcile() == 1
    run.refresh_from_db()
    assert run.status == "failed"
    assert run.status_reason.startswith(f"not submitted after {MAX_SUBMIT_ATTEMPTS} attempts: "
                                        "the task queue is unreachable")


class SilentPrefect:
    """A 'Prefect API' that accepts connections and never answers: the submission hangs in it,
    as it would on a stalled server, until the worker is killed."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.connections:
            conn.close()


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def test_a_worker_killed_mid_submit_loses_nothing(project, alice, dataset_version,  # noqa: F811
                                                  reward_version, own_redis, tmp_path):  # noqa: F811
    from django.db import connection
    from orchestration.sealing import CONTROL_KEY_ENV, new_key

    from webapp.runs.models import Run, RunToken
    from webapp.runs.services import run_create

    prefect = SilentPrefect()
    db = connection.settings_dict
    env = {**os.environ,
           "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:"
                           f"{db['PORT'] or 5432}/{db['NAME']}",
           "DJANGO_SETTINGS_MODULE": "webapp.config.settings.local",
           "CELERY_BROKER_URL": own_redis.url, "CELERY_RESULT_BACKEND": own_redis.url,
           "OOLONG_PREFECT_MODE": "server", "PREFECT_API_URL": f"http://127.0.0.1:{prefect.port}/api",
           "PREFECT_API_REQUEST_TIMEOUT": "600", "PREFECT_HOME": str(tmp_path / "prefect"),
           "OMP_NUM_THREADS": "1",
           # server mode seals each submission with the control plane's key (orchestration/sealing.py)
           CONTROL_KEY_ENV: new_key(),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "platform")])}
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-P", "prefork",
         "-c", "1", "--without-heartbeat", "--without-gossip", "--without-mingle",
         "--loglevel", "INFO"],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "ready" in log.read_text(), 90, "the Celery worker")
        run = run_create(project=project, user=alice, name="k", dataset_version=dataset_version,
                         reward_version=reward_version, spec={})
        wait_for(lambda: prefect.connections, 90, "the submission to reach the Prefect API")
        # Mid-submit: the flow's token is already committed (a flow the killed worker started
        # would hold a valid one), and nothing is recorded as submitted.
        assert RunToken.objects.filter(run=run, purpose="orchestrator").count() == 1
        (child,) = _children(worker.pid)
        seen = len(prefect.connections)
        time.sleep(0.5)  # the request is on the wire
        os.kill(child, signal.SIGKILL)
        # The message comes back (acks_late, reject_on_worker_lost) and a new pool child submits.
        wait_for(lambda: len(prefect.connections) > seen, 90,
                 "the submission to be tried again by the next worker process")
        assert child not in _children(worker.pid)
        run.refresh_from_db()
        assert run.status == "queued" and run.orchestrator_ref == ""
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=20)
        prefect.close()
    assert Run.objects.get(id=run.id).status == "queued"  # still in the outbox for reconcile


def test_a_retried_local_submission_finds_the_flow_it_started(tmp_path, monkeypatch):
    """Local mode: a worker killed between starting the flow and recording it used to start a
    second flow for the run on the retry."""
    from orchestration import trigger

    monkeypatch.setenv("OOLONG_RUNS_DIR", str(tmp_path))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")  # no database to prepare
    run_dir = trigger.flow_run_dir(7)
    run_dir.mkdir(parents=True)
    # What the killed worker left: a live flow of run 7, attempt 1, and its pid file.
    flow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "orchestration.flows.training_run", "--run-id", "7"])
    try:
        wait_for(lambda: b"training_run" in Path(f"/proc/{flow.pid}/cmdline").read_bytes(), 20,
                 "the stand-in flow to start")
        (run_dir / "flow-attempt-1.pid").write_text(str(flow.pid))
        started = []
        monkeypatch.setattr(trigger.subprocess, "Popen", lambda *a, **k: started.append(a))
        ref = trigger.submit_training_run(run_id=7, tracker_url="http://x", ingest_token="t")
        assert ref == f"local:{flow.pid}" and started == []
    finally:
        flow.kill()
        flow.wait()
