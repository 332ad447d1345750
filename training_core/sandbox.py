"""Run user reward code where it cannot hurt: a child process with CPU-time and address-space
limits, a wall-clock timeout, its own empty network namespace (``unshare -n``; where the kernel
refuses, sockets are disabled inside the interpreter) and a scratch working directory.

Never called from the web process: a Celery worker runs it (see tasks.reward_validate).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUNNER = r'''
import json, math, socket, sys

def _no_network(*a, **k):
    raise OSError("network access is disabled in the reward sandbox")

socket.socket = _no_network
socket.create_connection = _no_network
payload = json.load(sys.stdin)
sys.path.insert(0, ".")
out = {"results": []}
try:
    import user_reward
    fn = getattr(user_reward, payload["entrypoint"])
except BaseException as exc:
    out["error"] = f"import failed: {type(exc).__name__}: {exc}"
    print(json.dumps(out)); sys.exit(0)
for row in payload["rows"]:
    try:
        value = float(fn(row.get("completion", row.get("answer", "")), row))
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"returned {value}")
        out["results"].append({"reward": value})
    except BaseException as exc:
        out["results"].append({"error": f"{type(exc).__name__}: {exc}"[:500]})
print(json.dumps(out))
'''


@functools.cache  # the kernel's answer does not change while this worker runs
def _network_isolation_available() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def run_sandboxed(source: str, entrypoint: str, rows: list[dict[str, Any]], *, timeout_s: float = 10.0,
                  memory_mb: int = 512, cpu_s: int = 10) -> dict[str, Any]:
    """Call ``entrypoint(completion, row)`` for each row in a sandbox. Returns a report:
    {ok, results: [{reward}|{error}], error, network_isolated, elapsed_s, limits}."""
    isolated = _network_isolation_available()
    report: dict[str, Any] = {"ok": False, "results": [], "error": None,
                              "network_isolated": isolated,
                              "limits": {"timeout_s": timeout_s, "memory_mb": memory_mb, "cpu_s": cpu_s}}

    def limits() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
        # Soft below hard: the kernel sends SIGXCPU first, so the report can name the cause.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 2))
        resource.setrlimit(resource.RLIMIT_FSIZE, (10 * 2**20, 10 * 2**20))
        resource.setrlimit(resource.RLIMIT_NPROC, (256, 256))

    with tempfile.TemporaryDirectory(prefix="oolong-sandbox-") as tmp:
        Path(tmp, "user_reward.py").write_text(source)
        Path(tmp, "runner.py").write_text(RUNNER)
        cmd = [sys.executable, "-I", "-S", "runner.py"]
        if isolated:
            cmd = ["unshare", "-n", *cmd]
        env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=limits, text=True)
        try:
            out, err = proc.communicate(json.dumps({"entrypoint": entrypoint, "rows": rows}),
                                        timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            report["error"] = f"timed out after {timeout_s:g}s (killed)"
            report["elapsed_s"] = time.monotonic() - start
            return report
        report["elapsed_s"] = time.monotonic() - start
    if proc.returncode != 0:
        sig = -proc.returncode if proc.returncode < 0 else None
        why = {signal.SIGXCPU: f"CPU time limit ({cpu_s}s) exceeded",
               signal.SIGKILL: "killed (CPU time or memory limit)"}.get(sig, f"exit code {proc.returncode}")
        report["error"] = f"reward process died: {why}. {err.strip()[-500:]}".strip()
        return report
    try:
        body = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report["error"] = f"no result from the reward process. {err.strip()[-500:]}"
        return report
    report["results"] = body.get("results", [])
    report["error"] = body.get("error")
    failures = [r for r in report["results"] if "error" in r]
    if failures and not report["error"]:
        report["error"] = f"{len(failures)} of {len(rows)} sample rows raised: {failures[0]['error']}"
    report["ok"] = report["error"] is None and len(report["results"]) == len(rows)
    return report
