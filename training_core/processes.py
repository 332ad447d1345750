"""The lifecycle of a run's long-running processes: spawn, health, restart, stop. One module for
``oolong train``'s embedded fleet and for the orchestration flow's servers and trainer.

- Every process starts in its own session (process group), logging to its own file, so stopping
  it stops whatever it started (a launcher's ranks, SGLang's scheduler processes).
- ``stop_all`` signals every group at once and gives them one shared deadline before SIGKILL:
  stopping N servers takes one grace period, not N. It reaches what left the group too: a
  launcher's ranks in sessions of their own, and those orphaned by a launcher that died first
  (every process a ManagedProcess starts, and their descendants, carry its tag in their
  environment).
- A restarted server is handed back only after its ``bring_up`` callback (load the current
  weights and check the reply) has succeeded; until then it is not part of the fleet's healthy
  set, and a failure stops it again and raises.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from training_core.transport.http import wait_healthy

# What a run's processes inherit from whoever starts them (a flow, a worker, a shell): the
# toolchain, thread counts, caches, the accelerator and collective settings, and the durable
# store's credentials. Nothing else: no database URL, broker URL, secret key or token that
# happens to be in the parent's environment.
ENV_ALLOW = frozenset({
    "PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HOME", "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE", "OOLONG_CACHE", "OOLONG_NODE_ADDRESS", "OOLONG_CHECKPOINT_STORE",
    "OOLONG_RUN_ID",  # marks every process of a run (what an operator greps /proc for)
    "OOLONG_PROCESS_TAG",  # marks the processes a ManagedProcess started (stop_all finds them)
    "OOLONG_PORT_RANGE",  # the ports a node's processes may listen on (launch.free_port)
    "OOLONG_FUSED_DECODE",  # "0": the embedded servers decode through transformers' forward
    # "0": without the engine's C++ kernels / its AMX / its AVX-512 / its AVX2 projections
    "OOLONG_CPU_KERNELS", "OOLONG_AMX", "OOLONG_AVX512_LINEAR", "OOLONG_AVX2_LINEAR",
    "DS_ACCELERATOR", "TORCH_CUDA_ARCH_LIST", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    "http_proxy", "https_proxy", "no_proxy",
})
ENV_ALLOW_PREFIXES = ("NCCL_", "GLOO_", "FI_", "AWS_", "GOOGLE_APPLICATION_", "AZURE_STORAGE_")


def process_env(extra: dict[str, str] | None = None,
                parent: dict[str, str] | None = None) -> dict[str, str]:
    """The allow-listed part of ``parent`` (default: this process's environment) plus ``extra``."""
    source = os.environ if parent is None else parent
    env = {k: v for k, v in source.items() if k in ENV_ALLOW or k.startswith(ENV_ALLOW_PREFIXES)}
    return {**env, **(extra or {})}


PROCESS_TAG_ENV = "OOLONG_PROCESS_TAG"  # space-separated: a nested ManagedProcess adds its own


@dataclass
class ManagedProcess:
    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str] | None = None
    health_url: str | None = None  # GET answers 200 once it serves
    proc: subprocess.Popen | None = field(default=None, repr=False)
    # In the environment of everything it starts, inherited by their children: stop_all finds
    # them by it, even when their parent died and they were re-parented
    tag: str = field(default_factory=lambda: uuid.uuid4().hex, repr=False)
    swept: bool = field(default=False, repr=False)  # stop_all has looked for them since start

    def start(self) -> ManagedProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env[PROCESS_TAG_ENV] = f"{env.get(PROCESS_TAG_ENV, '')} {self.tag}".strip()
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        self.swept = False
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def wait_healthy(self, timeout_s: float) -> None:
        if self.health_url is None:
            return

        def dead() -> str | None:
            if self.alive():
                return None
            return f"{self.name} exited with {self.poll()}:\n{self.log_tail()}"

        try:
            wait_healthy(self.health_url, timeout_s, dead=dead)
        except TimeoutError:
            raise TimeoutError(f"{self.name} ({self.health_url}) not healthy after "
                               f"{timeout_s:.0f}s:\n{self.log_tail()}") from None

    def stop(self, grace_s: float = 10.0) -> None:
        stop_all([self], grace_s)


def stop_all(processes: Iterable[ManagedProcess | subprocess.Popen | None],
             grace_s: float = 10.0) -> None:
    """SIGTERM every process group, one shared deadline, then SIGKILL what is left.

    A group is not always the whole tree: ``torch.distributed.run`` starts each rank in a session
    of its own, and a launcher killed before it has stopped its ranks leaves them orphaned (a
    cancelled run whose trainer kept computing). So each leader's descendants are found through
    ``/proc`` while it still lives, signalled with it, and killed with it at the deadline; and a
    ManagedProcess's by its tag as well, which also finds the orphans of a leader that died
    before this call (a launcher killed by the OOM killer) and ranks started during the grace
    period by a launcher that then exited."""
    managed = [p for p in processes if p is not None]
    tags = {p.tag for p in managed
            if isinstance(p, ManagedProcess) and p.proc is not None and not p.swept}
    procs = [p.proc if isinstance(p, ManagedProcess) else p for p in managed]
    procs = [p for p in procs if p is not None and p.poll() is None]
    if not procs and not tags:  # stopped already (every ``finally`` stops again): no /proc scan
        return
    tree = (_descendants({p.pid for p in procs}) if procs else {}) | _tagged(tags)
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    for pid, started in tree.items():
        _signal_pid(pid, started, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            tree.update(_descendants({p.pid}))  # ranks started during the grace period
            _signal_group(p, signal.SIGKILL)
            p.wait()
    for p in procs:  # children that outlived their leader (a launcher's ranks)
        _signal_group(p, signal.SIGKILL)
    # Orphans of leaders that died before this call (no leader to wait for above) get the grace
    # period to stop on SIGTERM. Where a leader was waited for, what outlived it is killed at
    # once, as before: a cancel across nodes must end within the flows' budgets
    while (not procs and time.monotonic() < deadline
           and any(_alive(pid, started) for pid, started in tree.items())):
        time.sleep(0.05)
    tree.update(_tagged(tags))  # started while it stopped, by whichever parent
    for pid, started in tree.items():
        _signal_pid(pid, started, signal.SIGKILL)
    for p in managed:
        if isinstance(p, ManagedProcess):
            p.swept = True


def _signal_group(p: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(p.pid, sig)  # its own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def _stat(pid: int, *, waiting: bool = True) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process; None when it is gone (or a
    zombie), and with ``waiting`` False also when it sleeps uninterruptibly (state D: reading
    its environment could block on its memory map's lock)."""
    try:  # bytes: a name cut at 15 bytes may end inside a UTF-8 character
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        if fields[0] == b"Z" or (fields[0] == b"D" and not waiting):
            return None
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, started: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] == started


def _tagged(tags: set[str]) -> dict[int, int]:
    """Every live process (but this one) whose environment carries one of ``tags`` in
    PROCESS_TAG_ENV: pid -> start time. Other users' processes cannot be read, and carry no tag
    of ours."""
    if not tags:
        return {}
    found: dict[int, int] = {}
    prefix = PROCESS_TAG_ENV.encode() + b"="
    wanted = {t.encode() for t in tags}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        if (stat := _stat(pid, waiting=False)) is None:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            # the start time again: the environment read was of this process, not a successor
            if (var.startswith(prefix) and wanted.intersection(var[len(prefix):].split())
                    and _alive(pid, stat[1])):
                found[pid] = stat[1]
                break
    return found


def _descendants(roots: set[int]) -> dict[int, int]:
    """Every live descendant of ``roots``: pid -> start time (a pid reused later is not ours)."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for pid, started in parents.get(todo.pop(), []):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def _signal_pid(pid: int, started: int, sig: signal.Signals) -> None:
    stat = _stat(pid)
    if stat is None or stat[1] != started:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Fleet:
    """Rollout servers: one ManagedProcess per URL (none for servers someone else runs)."""

    urls: list[str]
    servers: list[ManagedProcess] = field(default_factory=list)

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        for server in self.servers:
            server.wait_healthy(max(deadline - time.monotonic(), 0.0))

    def alive(self) -> list[bool]:
        return [s.alive() for s in self.servers]

    def restart(self, i: int, *, bring_up: Callable[[str], None] | None = None,
                timeout_s: float = 300.0) -> None:
        """Stop server ``i`` if it still runs, start it again at the same URL, wait until it is
        healthy and ``bring_up(url)`` has succeeded (it raises otherwise)."""
        server = self.servers[i]
        server.stop(grace_s=5.0)
        server.start()
        try:
            server.wait_healthy(timeout_s)
            if bring_up is not None:
                bring_up(self.urls[i])
        except BaseException:
            server.stop(grace_s=5.0)
            raise

    def stop(self, grace_s: float = 10.0) -> None:
        stop_all(self.servers, grace_s)
