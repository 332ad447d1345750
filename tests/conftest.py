"""Test-wide settings: one torch thread per process (two collapse under contention on 2 cores),
a repo-local model cache, CPU DeepSpeed; and every test marked by what it costs.

Tests mirror the source tree (``tests/training_core/transport/`` tests
``training_core/transport/``), so a test's place says what it tests, not what it costs. Its cost
is a marker: a module that declares ``pytestmark = pytest.mark.unit`` is a unit test (no process,
no network, no browser, no database: ``make test-fast`` runs ``-m unit``); every other test takes
its top directory's marker (``engine`` under tests/training_core, ``integration`` under
tests/integration, ...; ``-m "not integration"`` and so on). The unit rule is enforced, not only
named: a unit test that starts a process or connects an internet socket fails (a Unix socket
pair, in-process, is allowed: the rollout client's tests script their server over one)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OOLONG_CACHE", str(ROOT / ".cache" / "oolong"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# tests/<directory> -> the marker its tests carry unless they declare `unit` (pyproject.toml).
COST_MARKERS = {"training_core": "engine", "webapp": "web", "security": "security",
                "orchestration": "orchestration", "integration": "integration", "infra": "infra",
                "benchmarks": "benchmarks", "workers": "workers"}


def _release_jail_images(config) -> None:
    """A root caller's jail images sit on a tmpfs that outlives the test that mounted it
    (training_core/jail/runtime.py): one under this session's temporary directory would make
    the next session's pytest unable to empty it (every test erroring at setup, as a CI run on a
    machine a clean-clone run had used once did). Released at the start and at the end."""
    factory = getattr(config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None) or config.option.basetemp
    if base and os.geteuid() == 0:
        from training_core.jail.runtime import release_images

        release_images(Path(base))


def pytest_sessionstart(session):
    _release_jail_images(session.config)


def pytest_sessionfinish(session, exitstatus):
    _release_jail_images(session.config)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("unit"):  # declared by its module: the cheapest cost
            continue
        parts = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests").parts
        marker = COST_MARKERS.get(parts[0]) if len(parts) > 1 else "layout"
        item.add_marker(getattr(pytest.mark, marker or parts[0]))


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process_and_open_no_network(request, monkeypatch):
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse_process(*args, **kwargs):
        raise AssertionError("a unit test started a process: drop its `pytest.mark.unit`")

    real_connect = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"a unit test opened a network connection to {address}: drop "
                                 "its `pytest.mark.unit`")
        return real_connect(sock, address)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_process)
    monkeypatch.setattr(socket.socket, "connect", connect)
