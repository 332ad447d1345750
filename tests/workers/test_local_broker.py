"""The local SQLite broker (the embedded default) shared by processes that start together."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# Each publisher waits for the same instant, then sends one task: the demo's worker and web app
# touching a fresh broker at once, made as likely as it can be.
PUBLISH = """
import sys, time
import django
django.setup()
from webapp.config.celery import app
start = float(sys.argv[1])
while time.time() < start:
    pass
app.send_task("oolong.nothing", args=[sys.argv[2]])
"""


def _local_env(data_dir: Path) -> dict[str, str]:
    env = {**os.environ, "OOLONG_DATA_DIR": str(data_dir), "DJANGO_SETTINGS_MODULE": "webapp.config.settings.local"}
    for name in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        env.pop(name, None)
    return env


def test_a_prepared_local_broker_takes_publishers_that_start_at_once(tmp_path):
    env = _local_env(tmp_path)
    prepared = subprocess.run([sys.executable, "manage.py", "oolong_broker"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert "broker ready: celery" in prepared.stdout
    db = tmp_path / "celery-broker.sqlite3"
    with sqlite3.connect(db) as conn:
        assert conn.execute("select name from kombu_queue").fetchall() == [("celery",)]

    start = time.time() + 8  # after every publisher has imported Django, even on a loaded host
    procs = [subprocess.Popen([sys.executable, "-c", PUBLISH, str(start), str(i)], cwd=ROOT, env=env,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(e[-1500:] for e in errors)
    with sqlite3.connect(db) as conn:
        assert conn.execute("select name from kombu_queue").fetchall() == [("celery",)]
        assert conn.execute("select count(*) from kombu_message").fetchone()[0] == 4

    again = subprocess.run([sys.executable, "manage.py", "oolong_broker", "--verbosity", "0"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == "", again.stderr[-2000:]
    with sqlite3.connect(db) as conn:  # idempotent: the queued messages are kept
        assert conn.execute("select count(*) from kombu_message").fetchone()[0] == 4
