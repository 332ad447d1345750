"""scripts/serve.sh's ingest pool (OOLONG_WEB_POOL=ingest): the gunicorn the proxy sends
/api/ingest/ to runs at a lower CPU priority than the web pool, serves the production settings,
and stores a batch before it acknowledges it."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
from django.db import connection

from training_core.ports import free_port
from webapp.tracking.models import MetricPoint, TrajectorySample

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.django_db(transaction=True)  # the server reads what the test wrote


def _env(**extra: str) -> dict[str, str]:
    db = connection.settings_dict
    login = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    url = f"postgres://{login}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    redis = os.environ.get("OOLONG_TEST_REDIS", "redis://127.0.0.1:6379/13")
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "webapp.config.settings.production",
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(50), "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
            "DATABASE_URL": url, "DJANGO_CACHE_URL": redis, "CELERY_BROKER_URL": redis,
            "DJANGO_SECURE_COOKIES": "0", "DJANGO_SECURE_SSL_REDIRECT": "0", **extra}


def _children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


@pytest.fixture
def ingest_pool(run):
    port = free_port()
    proc = subprocess.Popen(
        ["bash", "scripts/serve.sh", "--no-control-socket"], cwd=ROOT, start_new_session=True,
        env=_env(OOLONG_WEB_POOL="ingest", OOLONG_INGEST_BIND=f"127.0.0.1:{port}",
                 OOLONG_INGEST_WORKERS="1", OOLONG_INGEST_THREADS="2", OOLONG_INGEST_NICE="7"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                if httpx.get(base + "/accounts/login/", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("the ingest pool did not answer within 60 s")
        yield proc, base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=40)


def test_the_ingest_pool_is_niced_and_stores_before_it_acknowledges(ingest_pool, run, ingest_token):
    proc, base = ingest_pool
    workers = _children(proc.pid)
    assert workers and {_nice(p) for p in [proc.pid, *workers]} == {7}
    # Started in a session of its own: the session's share of the CPU is lowered too (the kernel
    # weighs sessions against each other before the nice values inside them).
    autogroup = Path(f"/proc/{proc.pid}/autogroup")
    if Path("/proc/sys/kernel/sched_autogroup_enabled").exists() and \
            Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
        assert autogroup.read_text().split()[-1] == "7", autogroup.read_text()
    auth = {"Authorization": f"Bearer {ingest_token}"}
    points = [{"key": "loss", "step": s, "value": s / 2, "time": 1000.0 + s} for s in range(50)]
    r = httpx.post(base + "/api/ingest/metrics/", json={"points": points}, headers=auth, timeout=30)
    assert r.status_code == 200 and r.json() == {"inserted": 50, "received": 50}
    samples = [{"step": 3, "index": i, "prompt": "p", "completion": "c", "reward": 0.5,
                "tokens": ["c"], "token_versions": [1]} for i in range(4)]
    r = httpx.post(base + "/api/ingest/trajectories/", json={"samples": samples}, headers=auth,
                   timeout=30)
    assert r.status_code == 200 and r.json() == {"stored": 4}
    assert MetricPoint.objects.filter(run=run).count() == 50
    assert TrajectorySample.objects.filter(run=run).count() == 4


def test_an_unknown_pool_is_refused():
    r = subprocess.run(["bash", "scripts/serve.sh"], cwd=ROOT, env=_env(OOLONG_WEB_POOL="both"),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "OOLONG_WEB_POOL" in r.stderr
