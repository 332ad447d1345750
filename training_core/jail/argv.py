"""The bwrap command line of a jail, and who runs it.

Who: a non-root caller starts bwrap itself (bwrap maps the jail's uid 65534 to the caller, which
is not root, and ``--disable-userns`` forbids nested user namespaces). A root caller never does
that: the mapped uid would be host root (a reward once wrote ``kernel.core_pattern`` and ran a
script as host root). bwrap then builds the namespaces with root's privileges (it binds the
runtime images from the platform's own cache, ``runtime.py``) and the jailed command starts
through ``setpriv`` as the dedicated system group ``oolong-jail`` and a uid of its own
(``uids.py``): to the kernel every jailed process is that uid, with no capabilities,
no-new-privs, and a seccomp filter that refuses new namespaces of any kind.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
from pathlib import Path

from training_core.jail import runtime
from training_core.jail.errors import SandboxUnavailable

JAIL_USER = "oolong-jail"
INSIDE_UID = 65534  # nobody, what a non-root caller's jail shows inside
RUNTIME_ROOTS = ("/usr", "/lib", "/lib64", "/bin")
FILES_DIR = "/oolong"  # read-only files handed in by fd (runner, user source)


@functools.cache
def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable("bwrap (Debian's bubblewrap package) is not installed: reward code "
                                 "runs only inside its jail. Install it: apt-get install bubblewrap")
    return path


def jail_user() -> tuple[int, int] | None:
    """(uid, gid) the jail runs as when the caller is root; None for a non-root caller."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(JAIL_USER)
    except KeyError:
        raise SandboxUnavailable(
            f"running as root, the jail needs the unprivileged system user {JAIL_USER!r} (reward "
            "code never runs as host root): create it with `bash scripts/services.sh jail` "
            f"(useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {JAIL_USER})"
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise SandboxUnavailable(f"the jail user {JAIL_USER!r} must not be uid or gid 0")
    if shutil.which("setpriv") is None:
        raise SandboxUnavailable("setpriv (util-linux) is missing: a root caller drops to the jail "
                                 "user with it")
    return entry.pw_uid, entry.pw_gid


def python() -> str:
    """The jail's interpreter: the runtime image's, at a neutral path (``runtime.py``; the
    image is built when the first jail is)."""
    return runtime.interpreter()


def runtime_paths() -> list[Path]:
    """The system libraries the jailed Python may read, each at its own path (the interpreter,
    its packages and training_core are images at neutral paths: ``runtime.py``)."""
    return [Path(p) for p in RUNTIME_ROOTS if Path(p).exists()]


# Kernel facts a jail has no use for, read as empty files: the boot command line, the build
# configuration and the kernel's symbol table (what an exploit looks up first), and the rest of
# what container runtimes mask.
MASKED_PROC = ("/proc/cmdline", "/proc/config.gz", "/proc/kallsyms", "/proc/kcore", "/proc/keys",
               "/proc/timer_list", "/proc/sched_debug", "/proc/modules", "/proc/iomem",
               "/proc/ioports", "/proc/latency_stats", "/proc/slabinfo", "/proc/vmallocinfo")


def jail_argv(argv: list[str], *, files: dict[str, int] | None = None,
              sockets: dict[str, str] | None = None, seccomp_fd: int | None = None,
              tmpfs_mb: int = 64, uid: int | None = None) -> list[str]:
    """bwrap + ``argv`` in the jail.

    ``/scratch`` (the working directory), ``/tmp`` and ``/dev/shm`` are ``tmpfs_mb`` tmpfs each:
    nothing of the jail is left on the host. ``files``: ``name -> fd`` copied read-only to
    ``/oolong/<name>``. ``sockets``: ``name -> host path`` of a Unix socket bound alone at
    ``/oolong/<name>`` (an agent's gateway session). ``seccomp_fd``: the filter
    (``seccomp.filter_fd()``); pass it in ``pass_fds``. ``uid``: for a root caller, the jail's
    own uid (``uids.lease()``; default: the ``oolong-jail`` user's). Use
    :func:`training_core.jail.spawn` unless you need the bare argv.
    """
    options, command = jail_parts(argv, files=files, sockets=sockets, seccomp_fd=seccomp_fd,
                                  tmpfs_mb=tmpfs_mb, uid=uid)
    return [bwrap_path(), *options, *command]


def jail_parts(argv: list[str], *, files: dict[str, int] | None = None,
               sockets: dict[str, str] | None = None, seccomp_fd: int | None = None,
               tmpfs_mb: int = 64, uid: int | None = None) -> tuple[list[str], list[str]]:
    """:func:`jail_argv` in two: bwrap's options (the jail's layout, host paths included) and the
    command it runs. :func:`training_core.jail.spawn` hands the options over by file descriptor
    (``--args``): the jail's PID 1 is bwrap, and its ``/proc/1/cmdline`` is readable in the jail."""
    user = jail_user()
    size = str(tmpfs_mb * 2**20)
    cmd: list[str] = []
    if user is None:
        cmd += ["--unshare-all", "--unshare-user", "--disable-userns",
                "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]
    else:
        # No user namespace: the jail is in the host's, as its own uid (setpriv below).
        # setpriv needs SETUID/SETGID to become that uid and SETPCAP to empty the bounding set.
        # Becoming a non-zero uid then clears them all.
        cmd += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
                "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    cmd += ["--cap-drop", "ALL"] if user is None else []
    cmd += ["--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "OMP_NUM_THREADS", "1",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "HOME", "/scratch",
            "--proc", "/proc",
            # Read-only whoever the jail is (bwrap covers them only when they look writable).
            "--ro-bind", "/proc/sys", "/proc/sys",
            "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger"]
    for path in MASKED_PROC:
        if os.path.exists(path):  # the jail's /proc is this kernel's: it has what ours has
            cmd += ["--ro-bind", "/dev/null", path]
    cmd += ["--dev", "/dev",
            "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
            "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    for path in runtime_paths():
        cmd += ["--ro-bind", str(path), str(path)]
    # The interpreter, its packages and training_core: images at neutral paths. bwrap makes
    # missing parents 0700 (root's): the jail user could not walk to them.
    image = runtime.current()
    for parent in ("/opt", "/opt/oolong"):
        cmd += ["--perms", "0755", "--dir", parent]
    cmd += ["--ro-bind", str(image.python_image), runtime.PYTHON_DIR,
            "--ro-bind", str(image.lib_image), runtime.LIB_DIR]
    for name, value in image.env:
        cmd += ["--setenv", name, value]
    # Mounted last, at paths no runtime path lies under (a later mount would hide it).
    cmd += ["--perms", "1777", "--size", size, "--tmpfs", "/scratch"]
    cmd += ["--perms", "0755", "--dir", FILES_DIR]
    for name, fd in (files or {}).items():
        cmd += ["--perms", "0444", "--ro-bind-data", str(fd), f"{FILES_DIR}/{name}"]
    for name, path in (sockets or {}).items():
        cmd += ["--bind", str(path), f"{FILES_DIR}/{name}"]
    cmd += ["--chdir", "/scratch"]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    command: list[str] = []
    if user is not None:
        jail_uid, gid = user
        command += ["/usr/bin/setpriv", f"--reuid={jail_uid if uid is None else uid}",
                    f"--regid={gid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                    "--"]
    return cmd, command + argv
