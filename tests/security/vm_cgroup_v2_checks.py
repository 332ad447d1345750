"""Checks that only make sense on a pure cgroup v2 kernel: run inside the VM by
test_jail_cgroup_v2_vm.py (not collected on the host: the file name does not start with test_).

The VM's command puts this pytest, and the shell that started it, in ``/oolong.service`` with
memory, pids and cpu available but not enabled below it, as systemd does for a unit with
``Delegate=yes``: the jail must move both into a leaf, enable the controllers and create its
cgroups beside that leaf. Unprivileged cases run as ``nobody`` through setpriv."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training_core.jail import Limits, cgroups
from training_core.sandbox import JailedWorker

pytestmark = pytest.mark.skipif(not Path("/sys/fs/cgroup/oolong.service").is_dir(),
                                reason="runs inside the VM of test_jail_cgroup_v2_vm.py only")

ROOT = Path(__file__).resolve().parents[2]
CGROUP = Path("/sys/fs/cgroup")
SERVICE = CGROUP / "oolong.service"
NOBODY = 65534
CHECK = "from training_core.jail import check_available; print(check_available())"
REFUSED = "delegates the memory, pids and cpu"


def _cgroup_of(pid: int | str) -> str:
    (line,) = Path(f"/proc/{pid}/cgroup").read_text().splitlines()  # v2 only: one line
    assert line.startswith("0::"), line
    return line[3:]


@contextlib.contextmanager
def _joining(cgroup: Path):
    """Keyword arguments for subprocess that start the child in ``cgroup`` (joined before exec)."""
    fd = os.open(cgroup / "cgroup.procs", os.O_WRONLY)
    try:
        yield {"preexec_fn": lambda: os.write(fd, b"0"), "pass_fds": (fd,)}
    finally:
        os.close(fd)


def _in_cgroup(cgroup: Path, code: str, *, uid: int | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` started in ``cgroup``, as root or as ``uid``."""
    argv = [sys.executable, "-c", code]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    with _joining(cgroup) as join:
        return subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=ROOT,
                              env={"PATH": os.environ["PATH"], "HOME": "/tmp",
                                   "PYTHONDONTWRITEBYTECODE": "1",
                                   # Each user its own cache of the jail's runtime images.
                                   "OOLONG_CACHE": f"/tmp/oolong-cache-{uid or 0}",
                                   "OOLONG_JAIL_PACKAGES": os.environ.get("OOLONG_JAIL_PACKAGES",
                                                                          "default")},
                              **join)


def _make(path: Path, subtree: str = "", owner: int | None = None) -> Path:
    path.mkdir(exist_ok=True)
    if subtree:
        (path / "cgroup.subtree_control").write_text(subtree)
    if owner is not None:  # what systemd's Delegate=yes hands a unit with User=
        for node in (path, path / "cgroup.procs", path / "cgroup.subtree_control",
                     path / "cgroup.threads"):
            os.chown(node, owner, owner)
    return path


def test_the_kernel_has_cgroup_v2_only_and_the_jail_uses_it():
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    assert [m[2] for m in mounts if m[1] == str(CGROUP)] == ["cgroup2"]
    assert not [m for m in mounts if m[2] == "cgroup"]  # no v1 hierarchy to fall back to
    assert cgroups.mode() == "v2"
    # cgroup v2 allows no processes beside child cgroups with controllers: this process and the
    # shell that started it (it shared the unit's cgroup) moved into the leaf.
    assert _cgroup_of("self") == f"/oolong.service/{cgroups.LEAF}"
    assert _cgroup_of(os.getppid()) == f"/oolong.service/{cgroups.LEAF}"
    assert (SERVICE / "cgroup.procs").read_text().split() == []
    assert {"cpu", "memory", "pids"} <= set((SERVICE / "cgroup.subtree_control").read_text().split())


def test_a_jail_gets_its_own_v2_cgroup_with_the_specified_limits():
    worker = JailedWorker({"kind": "source", "entrypoint": "reward"},
                          source="def reward(c, i):\n    return 1.0\n",
                          limits=Limits(jail_memory_mb=300, pids=32, cpus=0.5))
    try:
        (path,) = worker.jail.cgroup.dirs
        assert path.parent == SERVICE and path.name.startswith(cgroups.PREFIX)
        assert (path / "memory.max").read_text().strip() == str(300 * 2**20)
        assert (path / "memory.swap.max").read_text().strip() == "0"
        assert (path / "pids.max").read_text().strip() == "32"
        assert (path / "cpu.max").read_text().split() == ["50000", "100000"]
        # bwrap and everything it started, the jailed reward included, are in it.
        assert worker.jailed_pid is not None
        assert _cgroup_of(worker.jailed_pid) == f"/oolong.service/{path.name}"
        assert worker.proc.pid in worker.jail.cgroup.pids()
        assert worker.call("x", {}, 60)[1]["reward"] == 1.0
    finally:
        worker.kill()
    assert not path.exists()


def test_tmpfs_pages_count_against_the_jails_memory_max():
    """A 512 MB /tmp in a 128 MB jail: the jail's tmpfs pages are charged to its cgroup, so the
    writer is stopped (ENOMEM or the OOM killer) long before the tmpfs is full."""
    source = ("import json\n"
              "def reward(c, i):\n"
              "    n = 0\n"
              "    try:\n"
              "        with open('/tmp/fill', 'wb') as f:\n"
              "            for _ in range(400):\n"
              "                f.write(b'x' * 2**20); f.flush(); n += 1\n"
              "    except OSError:\n"
              "        pass\n"
              "    raise RuntimeError(json.dumps({'mb': n}))\n")
    worker = JailedWorker({"kind": "source", "entrypoint": "reward"}, source=source,
                          limits=Limits(jail_memory_mb=128, tmpfs_mb=512, file_mb=1000))
    try:
        status, answer = worker.call("x", {}, 120)
    finally:
        worker.kill()
    if status == "ok":
        written = json.loads(answer["error"].split(": ", 1)[1])["mb"]
        assert written < 128, answer
    else:  # the OOM killer took the runner: contained
        assert status == "died", (status, answer)


def test_without_delegated_controllers_user_code_is_refused():
    """Root, but in a cgroup whose parent hands down pids only: no memory bound, no jail."""
    partial = _make(CGROUP / "oolong-partial", subtree="+pids")
    unit = _make(partial / "unit.service")
    result = _in_cgroup(unit, CHECK)
    assert result.returncode != 0 and "SandboxUnavailable" in result.stderr, result
    assert REFUSED in result.stderr, result.stderr


def test_an_unprivileged_service_without_delegation_is_refused():
    """A non-root service in a root-owned cgroup (no Delegate=yes) cannot enable controllers."""
    unit = _make(CGROUP / "oolong-undelegated.service")
    result = _in_cgroup(unit, CHECK, uid=NOBODY)
    assert result.returncode != 0 and REFUSED in result.stderr, result
    assert list(unit.iterdir()) and not any(p.is_dir() for p in unit.iterdir())  # nothing made


def test_an_unprivileged_service_with_delegation_runs_bounded_jails():
    """Delegate=yes with User=: the service owns its cgroup, moves into a leaf, enables the
    controllers and bounds its jails (user-namespace bwrap, as any non-root caller)."""
    unit = _make(CGROUP / "oolong-user.service", owner=NOBODY)
    code = ("import json\n"
            "from training_core.jail import check_available\n"
            "from training_core.sandbox import run_sandboxed\n"
            "mode = check_available()\n"
            "src = 'def reward(c, i):\\n    return 1.0\\n'\n"
            "report = run_sandboxed(src, 'reward', [{'answer': '1', 'completion': '1'}],\n"
            "                       timeout_s=60)\n"
            "print(json.dumps({'mode': mode, 'ok': report['ok'], 'error': report.get('error')}))\n")
    result = _in_cgroup(unit, code, uid=NOBODY)
    assert result.returncode == 0, result
    found = json.loads(result.stdout.splitlines()[-1])
    assert found == {"mode": "v2", "ok": True, "error": None}, found
    assert {"cpu", "memory", "pids"} <= set((unit / "cgroup.subtree_control").read_text().split())
    assert (unit / cgroups.LEAF).is_dir()


def test_a_process_started_in_the_leaf_uses_its_parent_without_nesting():
    """A worker that already vacated its unit starts the next trainer inside the leaf: that one
    creates its jails beside the leaf as well, not under a second ``oolong-main``."""
    leaf = SERVICE / cgroups.LEAF
    result = _in_cgroup(leaf, "from training_core.jail import cgroups, check_available\n"
                              "print(check_available(), cgroups._v2_parent())")
    assert result.returncode == 0, result
    assert result.stdout.split()[-2:] == ["v2", str(SERVICE)], result.stdout
    assert not (leaf / cgroups.LEAF).exists()


def test_in_a_unit_not_delegated_other_processes_stay_and_user_code_is_refused():
    """Root in a unit systemd manages itself (no delegate mark), sharing it with another
    process: that process is not ours to move, so the controllers cannot be enabled and user
    code is refused."""
    unit = _make(CGROUP / "oolong-managed.service")
    with _joining(unit) as join:
        other = subprocess.Popen(["sleep", "300"], **join)
    try:
        result = _in_cgroup(unit, CHECK)
        assert result.returncode != 0 and REFUSED in result.stderr, result
        assert _cgroup_of(other.pid) == "/oolong-managed.service"
    finally:
        other.kill()
        other.wait()
