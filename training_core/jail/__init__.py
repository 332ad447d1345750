"""The jail for user code (rewards, agents): bubblewrap namespaces, never host root, a seccomp
filter, and one cgroup per jail bounding memory (tmpfs included), processes and CPU.

:func:`spawn` starts a command in a fresh jail; :class:`Jail` kills it whole. The parts:
``argv`` (the bwrap command line and who runs it), ``seccomp`` (the filter), ``cgroups`` (the
aggregate limits). ``training_core.sandbox`` builds the reward worker on top.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training_core.jail import cgroups, seccomp, uids
from training_core.jail.argv import (
    FILES_DIR,
    bwrap_path,
    jail_argv,
    jail_parts,
    jail_user,
    python,
    runtime_paths,
)
from training_core.jail.errors import SandboxUnavailable

__all__ = ["FILES_DIR", "PROTOCOL_PRELUDE", "Jail", "Limits", "SandboxUnavailable", "bwrap_path", "check_available",
           "jail_argv", "jail_parts", "jail_user", "python", "runtime_paths", "spawn"]


# The start of every jailed Python runner (rewards, agents): the protocol keeps a private dup of
# stdout and ``say`` writes one JSON line to it; whatever the user's code prints goes to
# /dev/null, so it cannot forge protocol lines through print. The runner imports os, sys, json.
PROTOCOL_PRELUDE = r'''
proto = os.fdopen(os.dup(1), "w", buffering=1)
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1); os.dup2(null, 2)
sys.stdout = sys.stderr = open(os.devnull, "w")

def say(obj):
    proto.write(json.dumps(obj) + "\n")
'''


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 2048  # address space per process: imports of math-verify / reasoning-gym need ~1 GB
    file_mb: int = 10
    cpu_s: int = 3600  # a backstop over the worker's life; each call has its own wall deadline
    answer_bytes: int = 64 * 1024  # one protocol line; a longer answer kills the worker
    start_timeout_s: float = 60.0
    # The jail as a whole (its cgroup): every process and its tmpfs pages together.
    jail_memory_mb: int = 2048
    pids: int = 64
    cpus: float = 1.0
    tmpfs_mb: int = 64  # each of /tmp, /dev/shm and /scratch

    @classmethod
    def with_memory(cls, memory_mb: int | None) -> Limits:
        """The defaults with ``memory_mb`` of address space per process (None: the default's);
        the jail as a whole gets at least as much, and never less than its default."""
        memory = memory_mb or cls.memory_mb
        return cls(memory_mb=memory, jail_memory_mb=max(memory, cls.jail_memory_mb))


def check_available() -> str:
    """Whether user code can be jailed here, as specified: raises SandboxUnavailable naming what
    is missing (bwrap, the jail user, libseccomp, cgroups). Returns the cgroup mode."""
    bwrap_path()
    jail_user()
    seccomp.filter_bpf()
    return cgroups.check_available()


@dataclass
class Jail:
    """One running jail: bwrap (``proc``) and everything in its cgroup, running as ``uid`` (a
    root caller's jail: its own leased uid; None for a non-root caller's user namespace)."""

    proc: subprocess.Popen
    cgroup: cgroups.JailCgroup
    uid_lease: uids.UidLease | None = None

    @property
    def uid(self) -> int | None:
        return self.uid_lease.uid if self.uid_lease is not None else None

    def freeze(self) -> bool:
        """Stop every thread of the jail (between calls); False where no freezer is here."""
        return self.cgroup.freeze()

    def thaw(self) -> None:
        self.cgroup.thaw()

    def kill(self) -> None:
        """bwrap's process group, then whatever else is in the cgroup (setsid children
        included), then the cgroup itself; then the jail's uid is free for another jail."""
        self.cgroup.thaw()  # a frozen task dies only once thawed (cgroup v1)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.cgroup.remove()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.uid_lease is not None and not self.cgroup.dirs:
            # Only once nothing of the jail is left: its uid must not run two jails at once.
            self.uid_lease.release()


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def spawn(argv: list[str], *, limits: Limits = Limits(), files: dict[str, str] | None = None,
          sockets: dict[str, str | Path] | None = None, **popen: Any) -> Jail:
    """Start ``argv`` in a fresh jail. ``files``: name -> text, readable at ``/oolong/<name>``
    (handed over by fd: nothing is written on the host). ``sockets``: name -> the host path of a
    Unix socket, bound alone at ``/oolong/<name>``. Other keywords go to ``Popen``."""
    bwrap_path()
    user = jail_user()
    bpf = seccomp.filter_bpf()
    lease = uids.lease() if user is not None else None
    try:
        cgroup = cgroups.JailCgroup(cgroups.CgroupLimits(limits.jail_memory_mb, limits.pids,
                                                         limits.cpus))
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    fds: list[int] = []
    join: list[int] = []
    try:
        seccomp_fd = _memfd("oolong-seccomp", bpf)
        fds.append(seccomp_fd)
        file_fds = {name: _memfd(f"oolong-{name}", text.encode()) for name, text in (files or {}).items()}
        fds += file_fds.values()
        join = cgroup.join_fds()

        def preexec() -> None:
            os.setsid()  # its own process group: killpg reaches bwrap and the jail
            cgroups.JailCgroup.join(join)  # before exec: bwrap and all it starts are bounded
            mem = limits.memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 2**20,) * 2)
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        options, command = jail_parts(
            argv, files=file_fds, sockets={k: str(v) for k, v in (sockets or {}).items()},
            seccomp_fd=seccomp_fd, tmpfs_mb=limits.tmpfs_mb,
            uid=lease.uid if lease is not None else None)
        # bwrap's options by fd: its command line is the jail's /proc/1/cmdline, and they name
        # host paths (the runtime images, an agent's socket). bwrap closes the fd once read.
        args_fd = _memfd("oolong-bwrap-args", "".join(f"{o}\0" for o in options).encode())
        fds.append(args_fd)
        cmd = [bwrap_path(), "--args", str(args_fd), *command]
        # env empty even for bwrap: the jail's PID 1 is bwrap's init, and /proc/1/environ is its.
        proc = subprocess.Popen(cmd, env={}, preexec_fn=preexec, close_fds=True,
                                pass_fds=tuple(fds), **popen)
    except BaseException:
        cgroup.remove()
        if lease is not None:
            lease.release()
        raise
    finally:
        for fd in fds + join:
            os.close(fd)
    return Jail(proc, cgroup, lease)
