"""A uid of its own for every concurrent jail of a root caller, from a reserved range.

The kernel keeps several limits per user, not per process or cgroup: inotify instances and
watches, pipe buffer pages, pending signals, POSIX message queues, RLIMIT_NPROC. Jails that share
one uid share them: one jail that opens ``fs.inotify.max_user_instances`` inotify instances
leaves none for every other jail on the machine. So a root caller runs each jail as its own uid,
leased from ``OOLONG_JAIL_UIDS`` (``first-last``, default 2147418112-2147422207: 4096 uids near
the top of the 31-bit range, where no distribution allocates users) for as long as the jail
lives. The group stays the system group ``oolong-jail``.

A lease is an exclusive ``flock`` on ``<lock dir>/<uid>``: machine-wide across every process
(trainers, Celery workers), and released by the kernel when its holder dies, so a killed trainer
leaks no uid. A uid with a passwd entry is never leased.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import random
from pathlib import Path

from training_core.jail.errors import SandboxUnavailable

DEFAULT_RANGE = (2147418112, 2147418112 + 4095)
LOCK_DIR = Path("/run/oolong-jail-uids")


def uid_range() -> tuple[int, int]:
    raw = os.environ.get("OOLONG_JAIL_UIDS", "")
    if not raw:
        return DEFAULT_RANGE
    try:
        first, last = (int(x) for x in raw.split("-"))
    except ValueError:
        raise SandboxUnavailable(f"OOLONG_JAIL_UIDS={raw!r}: write it as first-last, e.g. "
                                 "2147418112-2147422207") from None
    if not 1000 <= first <= last < 2**32 - 1:
        raise SandboxUnavailable(f"OOLONG_JAIL_UIDS={raw!r}: a range of unused uids above 1000")
    return first, last


class UidLease:
    """One leased uid; :meth:`release` (or the holder's death) gives it back."""

    def __init__(self, uid: int, fd: int):
        self.uid = uid
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


def _lock_dir() -> Path:
    for path in (LOCK_DIR, Path("/tmp/oolong-jail-uids")):
        try:
            path.mkdir(mode=0o700, exist_ok=True)
            if path.is_symlink() or path.stat().st_uid != os.geteuid():
                continue  # not ours: someone else could hand out our uids
            return path
        except OSError:
            continue
    raise SandboxUnavailable("no directory for the jail uid leases (/run/oolong-jail-uids)")


def lease() -> UidLease:
    """A uid of the range no other live jail on this machine holds."""
    first, last = uid_range()
    directory = _lock_dir()
    size = last - first + 1
    start = random.randrange(size)  # processes starting together rarely probe the same uids
    for i in range(size):
        uid = first + (start + i) % size
        fd = os.open(directory / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return UidLease(uid, fd)
        os.close(fd)  # a real user: never lend their uid to a jail
    raise SandboxUnavailable(f"every jail uid of {first}-{last} is in use (OOLONG_JAIL_UIDS): too "
                             "many jails at once on this machine")
