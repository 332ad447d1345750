"""The jail for reward code: every reward is scored inside it, built-in or the user's, wherever it
runs (validation in a worker, the trainer's reward pool, remote reward workers).

The jail is bubblewrap (``bwrap``; Debian's ``bubblewrap``, works unprivileged):
- new user (mapped to nobody), PID, network, IPC, UTS and cgroup namespaces, all capabilities
  dropped: no network at all, and the jail's ``/proc`` shows only its own processes;
- a read-only view of the Python runtime and installed packages (and ``training_core`` for the
  built-ins), nothing else of the host: no run directories, no database, no ``/etc``;
- a private, empty scratch directory as the working directory, a private ``/tmp``;
- an empty environment (no token, no database URL reaches it);
- rlimits on address space, file size and (as a backstop) CPU time;
- ``--die-with-parent`` and the jail's own PID namespace: killing bwrap kills every process in
  the jail, forked or ``setsid`` children included.

A :class:`JailedWorker` is one persistent jailed Python that scores calls one at a time over a
private line protocol (so many samples cost one start-up). The reward function cannot corrupt the
protocol: its stdout and stderr go to /dev/null. Each call has a deadline and each answer a size
cap; a worker that misses either is killed whole and replaced. Nothing the reward code says is
stored beyond a short, capped error message.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import training_core


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or refused to start: user code is never run outside the jail."""


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 2048  # address space: imports of math-verify / reasoning-gym need ~1 GB
    file_mb: int = 10
    cpu_s: int = 3600  # a backstop over the worker's life; each call has its own wall deadline
    answer_bytes: int = 64 * 1024  # one protocol line; a longer answer kills the worker
    start_timeout_s: float = 60.0


# The jailed side. fd 3 carries the protocol; the reward's own prints go to /dev/null.
RUNNER = r'''
import json, math, os, socket, sys
proto = os.fdopen(os.dup(1), "w", buffering=1)

def _no_network(*a, **k):  # the namespace has no route anyway; this names the cause
    raise OSError("network access is disabled in the reward sandbox")
socket.socket = socket.create_connection = _no_network
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1); os.dup2(null, 2)
sys.stdout = sys.stderr = open(os.devnull, "w")

def say(obj):
    proto.write(json.dumps(obj) + "\n")

def short(exc):
    return f"{type(exc).__name__}: {exc}"[:500]

spec = json.loads(sys.stdin.readline())
try:
    if spec["kind"] == "builtin":
        sys.path.insert(0, spec["package_root"])  # where training_core is mounted (read-only)
        from training_core.rewards.registry import resolve_reward
        fn = resolve_reward(spec["path"], spec["extract"])
        extracted = fn.extracted
    else:
        sys.path.insert(0, os.getcwd())
        import user_reward
        fn = getattr(user_reward, spec["entrypoint"])
        extracted = lambda completion: None
except BaseException as exc:
    say({"error": "import failed: " + short(exc)}); sys.exit(0)
say({"ready": True})
for line in sys.stdin:
    call = json.loads(line)
    try:
        value = float(fn(call["completion"], call["item"]))
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"returned {value}")
        say({"reward": value, "extracted": extracted(call["completion"])})
    except BaseException as exc:
        say({"error": short(exc)})
'''


@functools.cache
def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable("bwrap (Debian's bubblewrap package) is not installed: reward code "
                                 "runs only inside its jail. Install it: apt-get install bubblewrap")
    return path


def _runtime_paths() -> list[Path]:
    """What the jailed Python may read: the interpreter, the virtualenv (installed packages) and
    training_core (the built-in rewards), plus the system libraries."""
    paths = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(),
             Path(training_core.__file__).resolve().parent}
    paths |= {Path(p) for p in ("/usr", "/lib", "/lib64", "/bin") if Path(p).exists()}
    # Nested paths are covered by their parents.
    return sorted(p for p in paths if not any(q != p and q in p.parents for q in paths))


def jail_argv(argv: list[str], scratch: Path) -> list[str]:
    cmd = [bwrap_path(), "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
           "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "OMP_NUM_THREADS", "1",
           "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "HOME", "/scratch",
           "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for path in _runtime_paths():
        cmd += ["--ro-bind", str(path), str(path)]
    # Mounted last, at a path no runtime path lies under (a later mount would hide it).
    cmd += ["--bind", str(scratch), "/scratch", "--chdir", "/scratch"]
    return cmd + argv


def _python() -> str:
    # The virtualenv's interpreter: its pyvenv.cfg makes the installed packages importable.
    return str(Path(sys.prefix) / "bin" / "python")


class JailedWorker:
    """One jailed Python that scores ``(completion, item)`` calls for one reward."""

    def __init__(self, reward: dict[str, Any], *, source: str | None = None,
                 limits: Limits = Limits()):
        self.limits = limits
        # 0700, the launching user's: the jail's nobody maps to that user, so it can write here
        # and nobody else on the host can.
        self._scratch = Path(tempfile.mkdtemp(prefix="oolong-jail-"))
        (self._scratch / "runner.py").write_text(RUNNER)
        if source is not None:
            (self._scratch / "user_reward.py").write_text(source)
        self._buffer = b""
        reward = {**reward, "package_root": str(Path(training_core.__file__).resolve().parent.parent)}
        self.proc = subprocess.Popen(
            jail_argv([_python(), "-I", "runner.py"], self._scratch),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            # Empty even for bwrap: the jail's PID 1 is bwrap's init, and /proc/1/environ is its.
            env={}, preexec_fn=self._limits, close_fds=True)
        self._send(reward)
        status, answer = self._receive(limits.start_timeout_s)
        if status != "ok" or "ready" not in answer:
            error = answer.get("error") if isinstance(answer, dict) else answer
            self.kill()
            if status == "died" and not shutil.which("bwrap"):
                raise SandboxUnavailable("bwrap vanished")
            raise RuntimeError(f"reward worker did not start: {error or status}")

    def _limits(self) -> None:
        os.setsid()  # its own process group: killpg reaches bwrap and the jail
        mem = self.limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limits.file_mb * 2**20,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (self.limits.cpu_s, self.limits.cpu_s + 5))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def _send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def _receive(self, timeout_s: float) -> tuple[str, Any]:
        """One answer line: ("ok", dict) | ("timeout", None) | ("overflow", None) | ("died", None)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            if len(self._buffer) > self.limits.answer_bytes:
                return "overflow", None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout", None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return "died", None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        if len(line) > self.limits.answer_bytes:
            return "overflow", None
        try:
            return "ok", json.loads(line)
        except ValueError:
            return "died", None

    def call(self, completion: str, item: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
        """("ok", {"reward", "extracted"} | {"error"}) or a failure status; on a failure the worker
        is dead (killed here) and must be replaced."""
        try:
            self._send({"completion": completion, "item": item})
        except (BrokenPipeError, OSError):
            self.kill()
            return "died", None
        status, answer = self._receive(timeout_s)
        if status != "ok":
            self.kill()
        return status, answer

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def kill(self) -> None:
        """The whole jail: bwrap's process group; the jail's PID namespace takes the rest."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        shutil.rmtree(self._scratch, ignore_errors=True)


def failure_message(status: str, timeout_s: float, limits: Limits,
                    returncode: int | None = None) -> str:
    if status == "died" and returncode is not None:
        # bwrap exits 128 + the signal that ended the jailed process.
        sig = returncode - 128 if returncode > 128 else -returncode
        if sig == signal.SIGXCPU:
            return f"CPU time limit ({limits.cpu_s}s) exceeded (the jail was killed)"
        if sig == signal.SIGKILL:
            return "killed (CPU time or memory limit; the jail was killed)"
    return {"timeout": f"timed out after {timeout_s:g}s (the jail was killed)",
            "overflow": f"answer longer than {limits.answer_bytes} bytes (the jail was killed)",
            "died": "reward process died (memory, CPU or a crash; the jail was killed)"}[status]


def run_sandboxed(source: str, entrypoint: str, rows: list[dict[str, Any]], *, timeout_s: float = 10.0,
                  memory_mb: int | None = None, cpu_s: int | None = None) -> dict[str, Any]:
    """Validation: call ``entrypoint(completion, row)`` for each row (the row's ``completion``,
    else its ``answer``) in one jail. Returns {ok, results: [{reward}|{error}], error,
    network_isolated, elapsed_s, limits}; the whole run shares one deadline."""
    limits = Limits(memory_mb=memory_mb or Limits.memory_mb, cpu_s=cpu_s or Limits.cpu_s)
    report: dict[str, Any] = {"ok": False, "results": [], "error": None, "network_isolated": True,
                              "limits": {"timeout_s": timeout_s, "memory_mb": limits.memory_mb,
                                         "cpu_s": limits.cpu_s}}
    start = time.monotonic()
    try:
        worker = JailedWorker({"kind": "source", "entrypoint": entrypoint}, source=source,
                              limits=limits)
    except RuntimeError as exc:
        report["error"] = str(exc).removeprefix("reward worker did not start: ")
        report["elapsed_s"] = time.monotonic() - start
        return report
    try:
        for row in rows:
            left = timeout_s - (time.monotonic() - start)
            status, answer = worker.call(str(row.get("completion", row.get("answer", ""))), row,
                                         max(left, 0.01))
            if status != "ok":
                report["error"] = failure_message(status, timeout_s, limits, worker.returncode)
                break
            report["results"].append({k: v for k, v in answer.items() if k != "extracted"})
    finally:
        worker.kill()
    report["elapsed_s"] = time.monotonic() - start
    failures = [r for r in report["results"] if "error" in r]
    if failures and not report["error"]:
        report["error"] = f"{len(failures)} of {len(rows)} sample rows raised: {failures[0]['error']}"
    report["ok"] = report["error"] is None and len(report["results"]) == len(rows)
    return report
