"""A node's flow that sees its own cancel before Prefect's worker does stops its process and ends
Cancelled, not Crashed: a supervisor takes a crashed server for one to replace, a cancelled one
for the end. Against a real Prefect server and Prefect's flow engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT
from tests.integration.prefect_cluster import kill, start_server

pytestmark = pytest.mark.slow

FLOW = """
import os, sys
from pathlib import Path
from prefect import flow, get_client
from orchestration.flows.node_processes import _run_until_exit
from training_core.processes import ManagedProcess

@flow(name="held")
def held(log: str) -> None:
    proc = ManagedProcess("sleeper", ["sleep", "300"], Path(log)).start()
    print("PID", proc.pid, flush=True)
    _run_until_exit(proc, "sleeper", cancelling=lambda: True, poll_s=0.1)

final = held(sys.argv[1], return_state=True)
with get_client(sync_client=True) as client:
    run = client.read_flow_run(final.state_details.flow_run_id)
    print("STATE", run.state.type.value, run.state.message, flush=True)
"""


def test_a_flow_that_sees_its_cancel_first_stops_its_process_and_ends_cancelled(tmp_path):
    procs: list[subprocess.Popen] = []
    try:
        _, env = start_server(tmp_path, "oolong_test_node_cancel", procs)
        done = subprocess.run([sys.executable, "-c", FLOW, str(tmp_path / "sleeper.log")],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        for p in procs:
            kill(p)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.startswith(("PID ", "STATE ")))
    assert "STATE" in lines, done.stdout + done.stderr
    assert lines["STATE"].startswith("CANCELLED cancelled: sleeper on "), lines["STATE"]
    pid = int(lines["PID"])
    stat = ROOT / f"/proc/{pid}/stat"
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
