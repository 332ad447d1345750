"""The jail's seccomp filter, built with libseccomp (PyPI ``pyseccomp``: ctypes over Debian's
``libseccomp2``) and handed to bwrap as compiled BPF (``--seccomp FD``).

Default allow; the calls below fail with EPERM. They are what a reward never needs and what a
kernel or namespace escape starts with: mounts, new namespaces (nested user namespaces gave full
capabilities inside the old jail), ptrace, BPF, keyrings, perf, userfaultfd, kexec, modules,
io_uring. ``socket()`` and ``socketpair()`` work for AF_UNIX, AF_INET and AF_INET6 only
(EAFNOSUPPORT otherwise: AF_VSOCK ignores the network namespace).
``clone3`` answers ENOSYS (its flags sit behind a pointer a filter cannot read), so libc falls
back to ``clone``, whose namespace flags are refused here.
"""

from __future__ import annotations

import errno
import functools
import os

from training_core.jail.errors import SandboxUnavailable

DENIED = (
    "mount", "umount2", "umount", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "unshare", "setns",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "iopl", "ioperm",
    "open_by_handle_at", "name_to_handle_at", "personality", "lookup_dcookie",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    # io_uring runs work in kernel threads that seccomp never sees, and has been a rich source of
    # kernel bugs: no jail needs it (Python's asyncio does not use it).
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)

# The only address families a jail may open sockets in: Unix (the agent's gateway socket),
# IPv4 and IPv6 (the jail's own loopback; the network namespace has nothing else). AF_VSOCK
# ignores network namespaces (it reaches the host and its VMs), AF_NETLINK, AF_PACKET and the
# rest are kernel surface no reward needs. Others answer EAFNOSUPPORT, as on a kernel without them.
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}

# Every CLONE_NEW* flag (sched.h): clone with any of them is refused.
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080,
}


@functools.cache
def filter_bpf() -> bytes:
    """The compiled filter for this machine's architecture (built once per process)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # pyseccomp raises OSError when libseccomp is missing
        raise SandboxUnavailable(
            f"the jail's seccomp filter needs libseccomp ({exc}): install the 'pyseccomp' package "
            "(pip install -c constraints.txt pyseccomp) and Debian's libseccomp2 "
            "(bash scripts/services.sh jail)") from exc
    flt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, OSError):
            pass  # a call this architecture does not have (e.g. umount on x86_64)
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NAMESPACE_FLAGS.values():
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    allowed = set(SOCKET_FAMILIES.values())
    for call in ("socket", "socketpair"):
        for family in range(max(allowed)):
            if family not in allowed:
                flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.EQ, family))
        flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.GT, max(allowed)))
    fd = os.memfd_create("oolong-seccomp-build")
    with open(fd, "w+b") as out:
        flt.export_bpf(out)
        out.flush()
        out.seek(0)
        return out.read()


def filter_fd() -> int:
    """A fresh fd at offset 0 holding the filter, for one bwrap start (bwrap reads it to EOF, so
    concurrent starts never share one). Inheritable: pass it in ``pass_fds``; close it after."""
    fd = os.memfd_create("oolong-seccomp", 0)
    os.write(fd, filter_bpf())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
