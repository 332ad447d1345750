"""A node's flow holds its process until it exits, and stops it when the flow run is cancelled
even if Prefect's worker has not acted yet (its cancel event can lag behind a busy API)."""

from __future__ import annotations

import signal
import time

import pytest
from orchestration.flows.node_processes import _run_until_exit

from training_core.processes import ManagedProcess


@pytest.fixture(autouse=True)
def _keep_sigterm():
    """_run_until_exit installs its own SIGTERM handler (it runs as a flow run's process)."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _process(tmp_path, script: str) -> ManagedProcess:
    return ManagedProcess("p", ["bash", "-c", script], tmp_path / "p.log").start()


def test_a_cancel_read_from_the_flow_runs_state_stops_the_process(tmp_path):
    proc = _process(tmp_path, "while true; do sleep 0.1; done")
    cancel_at = time.monotonic() + 0.5
    reads = []

    def cancelling() -> bool:
        reads.append(time.monotonic())
        return time.monotonic() >= cancel_at

    with pytest.raises(SystemExit) as ended:
        _run_until_exit(proc, "trainer node 0", cancelling=cancelling, poll_s=0.1)
    assert ended.value.code == 143
    assert not proc.alive()
    assert len(reads) >= 2  # read more than once: the first answers "not cancelled"


def test_a_process_that_ends_returns_or_raises_with_its_log(tmp_path):
    _run_until_exit(_process(tmp_path, "sleep 0.2"), "rollout server 0",
                    cancelling=lambda: False, poll_s=0.1)
    failing = _process(tmp_path, "echo out of memory; exit 3")
    with pytest.raises(RuntimeError, match=r"rollout server 1 on .* exited with 3:\n.*out of memory"):
        _run_until_exit(failing, "rollout server 1", cancelling=lambda: False, poll_s=0.1)
