"""A Prefect server of its own for the tests that place runs on nodes (test_multinode,
test_simulated_cloud): its database, its process, and the helpers that start and stop the
processes around it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.integration.conftest import ROOT, wait_for
from training_core.ports import free_port


def prefect_env(api_url: str, home: Path) -> dict[str, str]:
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": str(home),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "platform")])}
    env.pop("DATABASE_URL", None)  # nodes hold no database credentials
    return env


def spawn(cmd: list[str], log: Path, env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def healthy(api: str) -> bool:
    try:
        return httpx.get(api + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_server(tmp_path: Path, database: str, procs: list[subprocess.Popen],
                 auth: str | None = None) -> tuple[str, dict[str, str]]:
    """A Prefect server on a fresh PostgreSQL database ``database`` (dropped and created), its
    process appended to ``procs`` before it is healthy (the caller's cleanup stops it). Returns
    its API URL and the environment its clients use (PREFECT_HOME under ``tmp_path``).
    ``auth``: the server requires this basic-auth credential (user:password), as production's
    does, and its clients' environment presents it."""
    psql = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-c"]
    subprocess.run([*psql, f"DROP DATABASE IF EXISTS {database}"], capture_output=True)
    subprocess.run([*psql, f"CREATE DATABASE {database}"], check=True, capture_output=True)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = prefect_env(api, tmp_path / "prefect-home")
    if auth:
        env["PREFECT_API_AUTH_STRING"] = auth
    server_env = {**env, "PREFECT_API_DATABASE_CONNECTION_URL":
                  f"postgresql+asyncpg://postgres@127.0.0.1:5432/{database}"}
    if auth:
        server_env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    procs.append(spawn([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                        "--port", str(port)], tmp_path / "prefect-server.log", server_env, tmp_path))
    wait_for(lambda: healthy(api), 120, "the Prefect server")
    return api, env
