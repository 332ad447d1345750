"""One cgroup per jail: the aggregate bound on memory (tmpfs pages included), processes and CPU
that per-process rlimits cannot give (four children of 250 MB each passed a 300 MB rlimit).

cgroup v2 where this process's own cgroup delegates (or may delegate: see :func:`_v2_parent`)
the ``memory``, ``pids`` and ``cpu`` controllers to its children (``memory.max``, ``pids.max``,
``cpu.max``); otherwise cgroup v1
hierarchies mounted at ``/sys/fs/cgroup/{memory,pids,cpu}`` (``memory.limit_in_bytes``,
``pids.max``, ``cpu.cfs_quota_us``). The jail's cgroup is created under the caller's own, and the
launching process joins it in ``preexec`` (before bwrap is exec'd), so every process of the jail
is in it from the start. Where neither can be used, :func:`check_available` raises
:class:`SandboxUnavailable`: user code is refused rather than run with less.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from training_core.jail.errors import SandboxUnavailable

ROOT = Path("/sys/fs/cgroup")
PREFIX = "oolong-jail-"
V1_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
_counter = itertools.count()


@dataclass(frozen=True)
class CgroupLimits:
    memory_mb: int
    pids: int
    cpus: float


def _own_paths() -> dict[str, str]:
    """``controller -> path`` of this process's cgroups (``""`` for the v2 line)."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


V2_NEEDED = {"memory", "pids", "cpu"}
LEAF = "oolong-main"  # where this process moves so that its own cgroup can delegate (v2)


@functools.cache
def _v2_parent() -> Path | None:
    """The v2 cgroup under which jails are created, or None.

    Either the caller's own cgroup already hands memory, pids and cpu to its children, or it
    can (they are in its ``cgroup.controllers`` and we may write it): cgroup v2 lets only a
    cgroup without processes of its own delegate, so if enabling them in place is refused
    (EBUSY), processes first move into a leaf ``oolong-main`` beside the jails (see
    :func:`_vacate`). A process started later inside that leaf (a worker's next trainer) uses
    the leaf's parent as it is, without a second level. Cached: this runs once per process."""
    path = _own_paths().get("")
    for mount in (ROOT, ROOT / "unified"):
        if path is None or not (mount / "cgroup.controllers").exists():
            continue
        parent = mount / path.lstrip("/")
        try:
            if parent.name == LEAF and V2_NEEDED <= _enabled(parent.parent):
                return parent.parent
            if V2_NEEDED <= _enabled(parent):
                return parent
            if not V2_NEEDED <= set((parent / "cgroup.controllers").read_text().split()):
                continue
            enable = " ".join(f"+{c}" for c in sorted(V2_NEEDED))
            try:
                (parent / "cgroup.subtree_control").write_text(enable)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                _vacate(parent, everyone=_delegated(parent, path))
                (parent / "cgroup.subtree_control").write_text(enable)
            return parent
        except OSError:  # not ours to write (no delegation), or a process would not move
            continue
    return None


def _enabled(cgroup: Path) -> set[str]:
    return set((cgroup / "cgroup.subtree_control").read_text().split())


def _delegated(cgroup: Path, path: str) -> bool:
    """Whether ``cgroup`` is ours to rearrange: a container's cgroup namespace root, a systemd
    unit with ``Delegate=yes`` (systemd >= 251 marks it with the ``trusted.delegate`` or
    ``user.delegate`` attribute), or, for a non-root caller, a cgroup its own user owns. In any
    other cgroup (a unit systemd manages itself, a login session) the other processes are not
    ours to move; systemd would also undo the controllers we enabled there."""
    if path == "/":
        return True
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(cgroup, name) in (b"1", b"true", b"yes"):
                return True
        except OSError:
            pass
    return os.getuid() != 0 and cgroup.stat().st_uid == os.getuid()


def _vacate(parent: Path, *, everyone: bool) -> None:
    """Move this process (``everyone``: every process of ``parent``, e.g. the shell or
    supervisor that started it, as container runtimes do) into the leaf ``LEAF``: v2 lets a
    cgroup with processes of its own enable no controller for its children (EBUSY). Repeated
    while processes fork in between. Without ``everyone``, enabling fails again if another
    process shares the cgroup, and user code is refused."""
    leaf = parent / LEAF
    leaf.mkdir(exist_ok=True)
    if not everyone:
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
        return
    procs = parent / "cgroup.procs"
    for _ in range(20):
        pids = _read_pids(procs)
        if not pids:
            return
        for pid in pids:
            try:
                (leaf / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass  # gone meanwhile
    raise OSError(errno.EBUSY, f"processes keep appearing in {procs}")


def _v1_freezer_parent() -> Path | None:
    """The v1 freezer hierarchy's cgroup of this process, where it is mounted and writable."""
    path = ROOT / "freezer" / _own_paths().get("freezer", "/").lstrip("/")
    return path if (path / "cgroup.procs").exists() and os.access(path, os.W_OK) else None


def _v1_parents() -> dict[str, Path] | None:
    own = _own_paths()
    parents = {c: ROOT / c / own.get(c, "/").lstrip("/") for c in V1_CONTROLLERS}
    if all((p / "cgroup.procs").exists() and os.access(p, os.W_OK) for p in parents.values()):
        return parents
    return None


@functools.cache
def mode() -> str:
    """'v2' or 'v1'; raises SandboxUnavailable (cached: said once, at the first jail)."""
    if _v2_parent() is not None:
        return "v2"
    if _v1_parents() is not None:
        return "v1"
    raise SandboxUnavailable(
        "reward code runs only in a jail with aggregate limits, and this process cannot create "
        "cgroups: run it where its own cgroup v2 delegates the memory, pids and cpu controllers "
        "(systemd: Delegate=yes; or write '+memory +pids +cpu' to its cgroup.subtree_control), "
        "or as root with cgroup v1 memory, pids and cpu hierarchies mounted under /sys/fs/cgroup")


def check_available() -> str:
    """Say at start whether jails can be bounded here (raises SandboxUnavailable if not)."""
    cgroup = JailCgroup(CgroupLimits(memory_mb=64, pids=8, cpus=1.0))
    cgroup.remove()
    return mode()


def _sweep(parent: Path) -> None:
    """Remove jail cgroups left by processes that are gone (a killed trainer)."""
    for child in parent.glob(PREFIX + "*"):
        try:
            owner = int(child.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
            for state, thawed in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                try:
                    (child / state).write_text(thawed)  # frozen tasks die only once thawed
                except OSError:
                    pass
            try:
                for pid in _read_pids(child / "cgroup.procs"):
                    os.kill(pid, signal.SIGKILL)
                child.rmdir()
            except OSError:
                pass


def _read_pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in path.read_text().split()]
    except (OSError, ValueError):
        return []


class JailCgroup:
    """The cgroup(s) of one jail: limits written, joined from ``preexec``, strays killed, removed."""

    def __init__(self, limits: CgroupLimits):
        self.mode = mode()
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.dirs: list[Path] = []
        self._freeze_file: Path | None = None
        self.frozen = False
        try:
            if self.mode == "v2":
                parent = _v2_parent()
                assert parent is not None
                _sweep(parent)
                path = parent / name
                path.mkdir()
                self.dirs = [path]
                (path / "memory.max").write_text(str(limits.memory_mb * 2**20))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
                (path / "pids.max").write_text(str(limits.pids))
                (path / "cpu.max").write_text(f"{int(limits.cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
                freeze = path / "cgroup.freeze"
                self._freeze_file = freeze if freeze.exists() else None
            else:
                parents = _v1_parents()
                assert parents is not None
                freezer = _v1_freezer_parent()
                for parent in [parents[c] for c in V1_CONTROLLERS] + ([freezer] if freezer else []):
                    _sweep(parent)
                    path = parent / name
                    path.mkdir()
                    self.dirs.append(path)
                memory, pids, cpu = self.dirs[:3]
                self._freeze_file = (self.dirs[3] / "freezer.state") if freezer else None
                (memory / "memory.limit_in_bytes").write_text(str(limits.memory_mb * 2**20))
                if (memory / "memory.memsw.limit_in_bytes").exists():
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_mb * 2**20))
                (pids / "pids.max").write_text(str(limits.pids))
                (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (cpu / "cpu.cfs_quota_us").write_text(str(int(limits.cpus * CPU_PERIOD_US)))
            self._procs_path = str(self.dirs[0] / "cgroup.procs")
        except OSError as exc:
            self.remove()
            raise SandboxUnavailable(f"could not set up the jail's cgroup ({exc}); reward code is "
                                     "not run without aggregate limits") from exc

    def join_fds(self) -> list[int]:
        """Open ``cgroup.procs`` files; the child writes ``0`` to each in ``preexec`` (join)."""
        return [os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for d in self.dirs]

    @staticmethod
    def join(fds: list[int]) -> None:
        """In the forked child, before exec: move this process into the jail's cgroup(s)."""
        for fd in fds:
            os.write(fd, b"0")

    def pids(self) -> list[int]:
        """The jail's processes, read after every call: opened afresh each time (cgroup v1 keeps
        the list it gave an open file for a second), with bare os calls (pathlib costs ~5x)."""
        if not self.dirs:
            return []
        # The memory hierarchy (v1) holds the same processes as the others.
        fd = os.open(self._procs_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = b""
            while chunk := os.read(fd, 65536):
                text += chunk
        finally:
            os.close(fd)
        return [int(p) for p in text.split()]

    def kill_except(self, keep: set[int], rounds: int = 50) -> bool:
        """Kill every process of the jail but ``keep``; True once none is left (a fork bomb
        racing the kill is bounded by pids.max and caught in later rounds)."""
        for _ in range(rounds):
            strays = [p for p in self.pids() if p not in keep and _alive(p)]
            if not strays:
                return True
            for pid in strays:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        return False

    def freeze(self) -> bool:
        """Stop every thread of the jail where they stand (cgroup v2 ``cgroup.freeze``, v1's
        freezer): between reward calls nothing of the jail runs, not even threads the reward
        left in its own process. False where this machine has no freezer for the jail."""
        if self._freeze_file is None or not self.dirs:
            return False
        self._freeze_file.write_text("1" if self.mode == "v2" else "FROZEN")
        self.frozen = True
        return True

    def thaw(self) -> None:
        if self.frozen and self._freeze_file is not None and self.dirs:
            try:
                self._freeze_file.write_text("0" if self.mode == "v2" else "THAWED")
            except OSError:
                pass  # removed meanwhile
        self.frozen = False

    def remove(self) -> None:
        """Kill what is left and remove the cgroup(s)."""
        self.thaw()
        for path in self.dirs:
            for _ in range(200):
                pids = [p for p in _read_pids(path / "cgroup.procs") if _alive(p)]
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        self.dirs = []


def _alive(pid: int) -> bool:
    """Not gone and not a zombie (a zombie waits for its parent and uses nothing). A zombie
    *leader* whose other threads run on (its main thread called exit(2) alone) is alive: its
    threads use CPU and memory, and SIGKILL to its pid ends them."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[0] != "Z":
        return True
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            state = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            return True
    return False


def ns_pid(pid: int) -> int | None:
    """The innermost PID-namespace pid of host process ``pid`` (the last ``NSpid`` field)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None

