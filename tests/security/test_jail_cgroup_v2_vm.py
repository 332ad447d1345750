"""The jail's cgroup v2 path on a real cgroup v2 kernel. This host mounts memory, pids and cpu on
cgroup v1, so the attack tests here exercise v1 only; production hosts are v2. One VM
(scripts/vm_run.py: Debian's kernel with ``cgroup_no_v1=all``, this machine's files read-only)
runs, as root, the existing attack tests that the jail's cgroup bounds or cleans up, plus
vm_cgroup_v2_checks.py (the v2 files and values, tmpfs charged to memory.max, refusal without
delegation, an unprivileged service with Delegate=yes). Here we check that all of them were
collected and passed. About 2-3 minutes where KVM cannot run a stock kernel (qemu's TCG)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vm_run", ROOT / "scripts" / "vm_run.py")
vm_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vm_run)

ESCAPE = "tests/security/test_jail_escape.py::"
ATTACKS = [ESCAPE + name for name in (
    "test_no_proc_sys_file_is_writable_and_core_pattern_is_untouched",
    "test_the_jailed_process_is_never_uid_0_to_the_host",
    "test_children_together_cannot_exceed_the_jail_memory",
    "test_tmpfs_fill_is_bounded",
    "test_fork_bomb_is_bounded_by_pids",
    "test_cpu_is_bounded_for_the_jail_as_a_whole",
    "test_a_child_left_burning_cpu_is_gone_before_the_next_call",
    "test_no_jail_leaves_anything_on_the_host",
    "test_without_cgroups_reward_code_is_refused_at_start",
    "test_cgroups_left_by_a_killed_trainer_are_swept",
)] + [f"tests/security/test_reward_jail.py::test_attack_is_contained_and_reported[{name}]"
      for name in ("allocate_10gb", "fork_setsid")]
CHECKS = [f"tests/security/vm_cgroup_v2_checks.py::{name}" for name in (
    "test_the_kernel_has_cgroup_v2_only_and_the_jail_uses_it",
    "test_a_jail_gets_its_own_v2_cgroup_with_the_specified_limits",
    "test_tmpfs_pages_count_against_the_jails_memory_max",
    "test_without_delegated_controllers_user_code_is_refused",
    "test_an_unprivileged_service_without_delegation_is_refused",
    "test_an_unprivileged_service_with_delegation_runs_bounded_jails",
    "test_a_process_started_in_the_leaf_uses_its_parent_without_nesting",
    "test_in_a_unit_not_delegated_other_processes_stay_and_user_code_is_refused",
)]


def _guest_script() -> str:
    base = Path(sys.base_prefix).resolve()
    lines = [
        "set -e",
        # As systemd sets up a unit with Delegate=yes: controllers enabled at the root, none below
        # the unit, whose cgroup holds the shell that starts the platform.
        "echo '+cpu +memory +pids' > /sys/fs/cgroup/cgroup.subtree_control",
        "mkdir /sys/fs/cgroup/oolong.service",
        f"{sys.executable} -c \"import os; os.setxattr('/sys/fs/cgroup/oolong.service',"
        " 'trusted.delegate', b'1')\"",  # what systemd >= 251 writes on a delegated unit
        "echo $$ > /sys/fs/cgroup/oolong.service/cgroup.procs",
    ]
    if base.is_relative_to("/root"):
        # /root is 0700: give `nobody` (the unprivileged cases) the interpreter, in the guest only.
        lines += ["mkdir /tmp/host-root && mount --bind /root /tmp/host-root",
                  "mount -t tmpfs -o mode=0755 tmpfs /root",
                  f"mkdir -p {base} && mount --bind /tmp/host-root/{base.relative_to('/root')} {base}"]
    lines += [
        # The share is read-only: everything written goes to the guest's tmpfs. The rewards
        # here need the standard library only: the jail's runtime image holds no packages (it is
        # built in the guest, at emulated speed).
        "export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false"
        " OOLONG_CACHE=/tmp/oolong-cache MPLCONFIGDIR=/tmp/matplotlib PYTHONDONTWRITEBYTECODE=1"
        " OOLONG_JAIL_PACKAGES=none",
        f"{sys.executable} -m pytest -p no:cacheprovider --basetemp=/tmp/pytest --color=no -q -rA"
        " --tb=short " + " ".join(f"'{node}'" for node in ATTACKS + CHECKS),
    ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def guest() -> tuple[int, str]:
    reason = vm_run.missing()
    if reason:
        pytest.skip(f"no VM here: {reason}")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "vm_run.py"), "--timeout", "420",
                           "--", _guest_script()], capture_output=True, text=True, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def _passed(output: str) -> set[str]:
    return {m.strip() for m in re.findall(r"^PASSED (.+)$", output, re.MULTILINE)}


def test_the_jail_attack_tests_pass_on_a_cgroup_v2_kernel(guest):
    status, output = guest
    assert status == 0, output[-6000:]
    assert set(ATTACKS) <= _passed(output), output[-6000:]


def test_the_v2_checks_pass_in_the_vm(guest):
    status, output = guest
    assert set(CHECKS) <= _passed(output), output[-6000:]
    # Everything asked for ran and passed: nothing skipped, deselected or missing.
    assert re.search(rf"^{len(ATTACKS) + len(CHECKS)} passed(, \d+ warnings?)? in ", output, re.MULTILINE), output[-3000:]
