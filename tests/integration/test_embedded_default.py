"""The no-server default end to end: SQLite, Celery on a local SQLite broker, Prefect without a
server, through the same REST API -> Celery -> Prefect -> trainer path (the demo script)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training_core.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_path_on_sqlite_local_broker_and_prefect_local_mode(tmp_path):
    env = {**os.environ, "OOLONG_RUNS_DIR": str(tmp_path / "runs")}
    for name in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "PREFECT_API_URL"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "scripts/demo.py", "--exit", "--data-dir", str(tmp_path / "web"),
         "--port", str(free_port()), "trainer.steps=3", "model.warm_start_seconds=1",
         "eval.every=3", "eval.size=8", "rollout.group_size=4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "run 1 succeeded" in out.stdout
    assert "greedy eval accuracy" in out.stdout
    assert (tmp_path / "web" / "db.sqlite3").exists()  # the embedded default database was used
    assert (tmp_path / "runs" / "flows" / "run-1" / "metrics.jsonl").exists()
