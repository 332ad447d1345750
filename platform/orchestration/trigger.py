"""How the web side starts and stops training-run flows. The only orchestration module the web
app and workers import; it never runs a flow in the calling process.

Modes (OOLONG_PREFECT_MODE):
- ``local`` (default, no servers): a detached process runs the flow on Prefect's ephemeral
  engine, with a project-local PREFECT_HOME.
- ``server``: the `training-run/training-run` deployment on a Prefect server
  (PREFECT_API_URL, and PREFECT_API_AUTH_STRING: the server requires authentication), with an
  idempotency key so a retried submission starts one flow run.

The flow's token is never a flow parameter (Prefect shows parameters to every client, the nodes
of every run included): in local mode it travels in the flow process's environment, in server
mode sealed with the control plane's key, ``OOLONG_CONTROL_KEY`` (sealing.py), which the web
app's workers and the flows' worker share and no node has.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from orchestration.sealing import CONTROL, CONTROL_KEY_ENV, RunCredential, key_from_env
from training_core.processes import process_env

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = "training-run/training-run"
TOKEN_ENV = "OOLONG_INGEST_TOKEN"  # the flow's token in local mode (its environment)


def flow_credential(run_id: int, *, sealed: str = "", tracker_url: str = "") -> RunCredential:
    """The training-run flow's own credential: opened from ``sealed`` with the control plane's
    key (server mode), else ``$OOLONG_INGEST_TOKEN`` and ``tracker_url`` (local mode)."""
    if sealed:
        return RunCredential.unseal(key_from_env(CONTROL_KEY_ENV), sealed, purpose=CONTROL,
                                    run_id=run_id)
    token = os.environ.get(TOKEN_ENV, "")
    if not token or not tracker_url:
        raise RuntimeError(f"the training-run flow of run {run_id} got no credential: a sealed "
                           f"one (server mode), or {TOKEN_ENV} in its environment and a tracker "
                           "URL (local mode)")
    return RunCredential(run_id, tracker_url, token)


def flow_run_dir(run_id: int) -> Path:
    """Where a run's flow keeps its files (spec, data, weights, checkpoints, logs)."""
    return Path(os.environ.get("OOLONG_RUNS_DIR", ROOT / "runs")) / "flows" / f"run-{run_id}"


def sweep_dir(sweep_id: int) -> Path:
    """What the runs of a sweep share on this machine (their warm start)."""
    return Path(os.environ.get("OOLONG_RUNS_DIR", ROOT / "runs")) / "sweeps" / f"sweep-{sweep_id}"


# What a flow inherits beyond what every run process does (training_core.processes.ENV_ALLOW):
# Prefect's settings, the platform's own, Terraform's. An allow-list, like the processes': the
# web app's database, broker and secret key never reach a flow, nor anything else that happens
# to be in the worker's environment.
FLOW_ENV_PREFIXES = ("PREFECT_", "OOLONG_", "TF_")


def prefect_env() -> dict[str, str]:
    env = process_env({k: v for k, v in os.environ.items() if k.startswith(FLOW_ENV_PREFIXES)})
    env.setdefault("PREFECT_HOME", str(ROOT / ".cache" / "prefect"))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    env.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    paths = [str(ROOT), str(ROOT / "platform"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def prefect_database_ready(env: dict[str, str]) -> bool:
    """Create or migrate the local engine's database once, under a lock; True if this call did.

    In local mode every flow starts Prefect's ephemeral server on one SQLite database under
    PREFECT_HOME. Two first starts at once (the runs of a sweep) race on creating it: one fails
    with "index ... already exists" and its run never reports, so it stays queued."""
    home = Path(env["PREFECT_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    marker = home / f".oolong-migrated-{version('prefect')}"
    if marker.exists():
        return False
    with open(home / ".oolong-migrate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if marker.exists():
            return False
        subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                       env=env, check=True, capture_output=True, timeout=600,
                       stdin=subprocess.DEVNULL)
        marker.touch()
        return True


def submit_training_run(*, run_id: int, tracker_url: str, ingest_token: str,
                        provider: str = "local", attempt: int = 1) -> str:
    """Start the run's flow; attempts after the first resume from the latest checkpoint."""
    mode = os.environ.get("OOLONG_PREFECT_MODE", "local")
    resume = attempt > 1
    if mode == "server":
        from prefect.deployments import run_deployment

        sealed = RunCredential(run_id, tracker_url, ingest_token).seal(
            key_from_env(CONTROL_KEY_ENV), purpose=CONTROL)
        flow_run = run_deployment(DEPLOYMENT, timeout=0,
                                  idempotency_key=f"oolong-run-{run_id}-{attempt}",
                                  parameters={"run_id": run_id, "provider": provider,
                                              "resume": resume, "sealed": sealed})
        return f"prefect:{flow_run.id}"
    runs_dir = flow_run_dir(run_id)
    runs_dir.mkdir(parents=True, exist_ok=True)
    env = prefect_env()
    if "PREFECT_API_URL" not in env:  # the ephemeral engine: its database must exist first
        prefect_database_ready(env)
    env[TOKEN_ENV] = ingest_token  # not on the command line (ps), nor a parameter (Prefect's API)
    env["OOLONG_RUN_ID"] = str(run_id)  # inherited by every process of the run (teardown checks)
    # [issue 47] One flow per (run, attempt), as the server mode's idempotency key gives: a
    # submission retried after a worker died between starting the flow and recording it finds
    # the flow it started instead of starting a second.
    pid_file = runs_dir / f"flow-attempt-{attempt}.pid"
    with open(runs_dir / ".submit.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        started = _local_flow(pid_file, run_id)
        if started is not None:
            return f"local:{started}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestration.flows.training_run", "--run-id", str(run_id),
             "--tracker-url", tracker_url, "--provider", provider,
             *(["--resume"] if resume else [])],
            cwd=ROOT, env=env, stdout=(runs_dir / "flow.log").open("a"),
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        pid_file.write_text(str(proc.pid))
    return f"local:{proc.pid}"


def _local_flow(pid_file: Path, run_id: int) -> int | None:
    """The pid of this run's live local flow recorded in ``pid_file``, if it still runs."""
    try:
        pid = int(pid_file.read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    ours = b"orchestration.flows.training_run" in argv and str(run_id).encode() in argv
    return pid if ours and flow_alive(f"local:{pid}") else None


def flow_alive(ref: str) -> bool | None:
    """True/False where it can tell, None where it cannot (e.g. no Prefect server reachable)."""
    kind, _, ident = ref.partition(":")
    if kind == "local":
        try:
            os.kill(int(ident), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie (exited, not reaped) is not alive.
        try:
            state = Path(f"/proc/{ident}/stat").read_text().split()[2]
            return state != "Z"
        except OSError:
            return True
    if kind == "prefect":
        try:
            import asyncio

            from prefect.client.orchestration import get_client

            async def state() -> bool:
                async with get_client() as client:
                    fr = await client.read_flow_run(ident)
                    return not fr.state.is_final()

            return asyncio.run(state())
        except Exception:  # noqa: BLE001
            return None
    return None


def kill_flow(ref: str) -> None:
    """Last resort after a cancel request the flow did not honour."""
    kind, _, ident = ref.partition(":")
    if kind == "local":
        try:
            os.killpg(int(ident), signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    elif kind == "prefect":
        import asyncio

        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        async def cancel() -> None:
            async with get_client() as client:
                await client.set_flow_run_state(ident, Cancelling(), force=True)

        asyncio.run(cancel())
