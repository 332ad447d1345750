"""The cgroup v2 side of the jail's limits. This machine mounts the memory, pids and cpu
controllers on cgroup v1, so no v2 hierarchy with them can exist here; these tests run the v2
code against a directory laid out as cgroupfs v2 is (the files the kernel reads and writes),
which is the one thing they can check here: which files get which values. The v1 side and the
limits' effect are tested for real in tests/security/test_jail_escape.py, the v2 side on a real v2
kernel in a VM by tests/security/test_jail_cgroup_v2_vm.py."""

from __future__ import annotations

import os

import pytest

from training_core.jail import cgroups

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


@pytest.fixture
def v2_tree(tmp_path, monkeypatch):
    root = tmp_path / "cgroup"
    own = root / "system.slice" / "oolong.service"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (own / "cgroup.controllers").write_text("cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("\n")
    (own / "cgroup.procs").write_text(f"{os.getpid()}\n")
    monkeypatch.setattr(cgroups, "ROOT", root)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {"": "/system.slice/oolong.service"})
    cgroups._v2_parent.cache_clear()
    cgroups.mode.cache_clear()
    yield own
    cgroups._v2_parent.cache_clear()
    cgroups.mode.cache_clear()


def test_a_delegatable_cgroup_enables_the_controllers_and_jails_get_v2_limits(v2_tree):
    assert cgroups.mode() == "v2"
    enabled = (v2_tree / "cgroup.subtree_control").read_text().split()
    assert sorted(enabled) == ["+cpu", "+memory", "+pids"]
    jail = cgroups.JailCgroup(cgroups.CgroupLimits(memory_mb=300, pids=32, cpus=0.5))
    (path,) = jail.dirs
    assert path.parent == v2_tree and path.name.startswith(cgroups.PREFIX)
    assert (path / "memory.max").read_text() == str(300 * 2**20)
    assert (path / "pids.max").read_text() == "32"
    assert (path / "cpu.max").read_text() == f"{cgroups.CPU_PERIOD_US // 2} {cgroups.CPU_PERIOD_US}"


def test_without_the_controllers_v2_is_not_used(v2_tree, monkeypatch):
    (v2_tree / "cgroup.controllers").write_text("cpu io\n")  # memory and pids not delegated
    monkeypatch.setattr(cgroups, "_v1_parents", lambda: None)
    with pytest.raises(cgroups.SandboxUnavailable, match="Delegate=yes"):
        cgroups.mode()
    assert (v2_tree / "cgroup.subtree_control").read_text().strip() == ""
