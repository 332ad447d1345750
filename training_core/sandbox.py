"""The reward worker: every reward is scored inside the jail (``training_core.jail``), built-in
or the user's, wherever it runs (validation in a worker, the trainer's reward pool, remote reward
workers).

The jail (see ``training_core/jail/``) is bubblewrap: new PID, network, IPC, UTS and cgroup
namespaces (no network at all; ``/proc`` shows only the jail's processes); never host root (a
root caller's jail runs as the system user ``oolong-jail``); ``/proc/sys`` read-only; a seccomp
filter refusing mounts, new namespaces, ptrace, BPF, keyrings and module loading; a read-only
runtime image at neutral paths (the interpreter, the allowed packages and training_core: no host
path of them shows) and nothing else of the host; sized tmpfs for
``/scratch`` (the working directory), ``/tmp`` and ``/dev/shm``; an empty environment; rlimits per
process and one cgroup per jail bounding memory (tmpfs included), processes and CPU.

A :class:`JailedWorker` is one persistent jailed Python that scores calls one at a time over a
private line protocol (so many samples cost one start-up). Every request carries a sequence id
that its reply must echo; a reply with another id or another shape than ``{id, reward,
extracted}`` (a finite number) or ``{id, error}``, a line that is not strict JSON (NaN, Infinity,
nesting that raises RecursionError), or any byte the worker sends unasked, kills the worker (a
reward writing to the protocol fd can never shift answers onto later calls, nor hand the trainer
a NaN). The reward's own stdout and stderr go to /dev/null. Each call has a deadline and each
answer a size cap; a worker that misses either is killed whole and replaced. After every call,
any process the call left behind in the jail is killed, and a runner that kept threads is frozen
with the jail until the next call. Nothing the reward says is stored beyond a short, capped error message.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from training_core.jail import (
    FILES_DIR,
    PROTOCOL_PRELUDE,
    Limits,
    SandboxUnavailable,
    bwrap_path,
    jail_argv,
    python,
    spawn,
)
from training_core.jail.cgroups import ns_pid
from training_core.jail.runtime import LIB_DIR

__all__ = ["JailedWorker", "Limits", "SandboxUnavailable", "bwrap_path", "failure_message",
           "jail_argv", "run_sandboxed"]

# The jailed side. The protocol goes over a private dup of stdout; the reward's prints go to
# /dev/null. Each reply echoes its request's id.
# No socket patching: the network namespace refuses the network, and replacing library classes
# with functions breaks imports (ssl's `class SSLSocket(socket.socket)`).
RUNNER = "import errno, json, math, os, sys\n" + PROTOCOL_PRELUDE + r'''

NO_NETWORK = {errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH}

def short(exc):
    text = f"{type(exc).__name__}: {exc}"[:450]
    cause = getattr(exc, "reason", exc)  # urllib wraps the socket's error
    if isinstance(cause, OSError) and (cause.errno in NO_NETWORK
                                       or type(cause).__name__ == "gaierror"):
        text += " (the reward jail has no network)"
    return text

def reap():
    # Children the call left are killed from outside; their zombies are ours to collect.
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass

spec = json.loads(sys.stdin.readline())
try:
    if spec["kind"] == "builtin":
        sys.path.insert(0, spec["package_root"])  # training_core's image (read-only)
        from training_core.rewards.registry import resolve_reward
        fn = resolve_reward(spec["path"], spec["extract"])
        extracted = fn.extracted
    else:
        sys.path.insert(0, "FILES_DIR")
        import user_reward
        fn = getattr(user_reward, spec["entrypoint"])
        extracted = lambda completion: None
except BaseException as exc:
    say({"error": "import failed: " + short(exc)}); sys.exit(0)
say({"ready": True, "pid": os.getpid()})
for line in sys.stdin:
    reap()  # what the last call left was killed after its answer
    call = json.loads(line)
    try:
        value = float(fn(call["completion"], call["item"]))
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"returned {value}")
        say({"id": call["id"], "reward": value, "extracted": extracted(call["completion"])})
    except BaseException as exc:
        say({"id": call["id"], "error": short(exc)})
'''.replace("FILES_DIR", FILES_DIR)


_NO_CONSTANT = object()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def strict_json(line: bytes) -> Any:
    """A reply line as JSON, or ``_NO_CONSTANT`` where it is not strict JSON: ``NaN`` and
    ``Infinity`` (which Python's parser takes by default) and nesting deep enough to raise
    RecursionError (which no ``except ValueError`` catches) are refused like any garbage."""
    try:
        return json.loads(line, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return _NO_CONSTANT


ERROR_CHARS = 1000  # what the host keeps of a reward's error text


def valid_reply(answer: dict[str, Any], seq: int) -> bool:
    """A reward call's reply is ``{"id", "reward", "extracted"}`` with a finite number and text
    (or null), or ``{"id", "error"}`` with text; ``id`` echoes the call's (an int, not ``true``).
    Anything else is the worker writing to the protocol on its own."""
    if type(answer.get("id")) is not int or answer["id"] != seq:
        return False
    if answer.keys() == {"id", "error"}:
        if not isinstance(answer["error"], str):
            return False
        answer["error"] = answer["error"][:ERROR_CHARS]
        return True
    if answer.keys() - {"extracted"} != {"id", "reward"}:
        return False
    reward, extracted = answer["reward"], answer.get("extracted")
    return (type(reward) in (int, float) and math.isfinite(reward)
            and (extracted is None or isinstance(extracted, str)))


class JailedWorker:
    """One jailed Python that scores ``(completion, item)`` calls for one reward."""

    def __init__(self, reward: dict[str, Any], *, source: str | None = None,
                 limits: Limits = Limits(), start_timeout_s: float | None = None):
        self.limits = limits
        self._buffer = b""
        self._seq = 0
        files = {"runner.py": RUNNER}
        if source is not None:
            files["user_reward.py"] = source
        reward = {**reward, "package_root": LIB_DIR}
        self.jail = spawn([python(), "-I", f"{FILES_DIR}/runner.py"], limits=limits, files=files,
                          # bwrap's own complaints; the runner points the jail's fd 2 at
                          # /dev/null before any reward code runs, so this is never the reward's.
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.proc = self.jail.proc
        self._keep: set[int] = set()
        self.jailed_pid: int | None = None
        self._threads = 0
        try:
            self._send(reward)
            status, answer = self._receive(limits.start_timeout_s if start_timeout_s is None
                                           else start_timeout_s)
        except OSError:  # bwrap gone before reading its first line
            status, answer = "died", None
        if status != "ok" or "ready" not in answer:
            error = answer.get("error") if isinstance(answer, dict) else None
            returncode = self.proc.poll()
            if returncode is None and status == "died":
                # Its stdout closed as it exited: wait for the exit, or bwrap's reason (on its
                # stderr) goes unread and a setup error looks like a crash.
                try:
                    returncode = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            said = self._stderr() if returncode is not None else ""
            self.kill()
            if said.startswith("bwrap:"):
                raise SandboxUnavailable(f"the jail could not be built: {said}")
            # The interpreter's own complaint (e.g. a runtime the jail user may not read).
            raise RuntimeError(f"reward worker did not start: {error or status}"
                               + (f" ({said[-500:]})" if said and not error else ""))
        # What stays between calls: bwrap, its init (pid 1 in the jail) and the runner.
        inner = {1, answer.get("pid", 2)}
        self._keep = {self.proc.pid} | {p for p in self.jail.cgroup.pids() if ns_pid(p) in inner}
        self.jailed_pid = next((p for p in self._keep if ns_pid(p) == answer.get("pid")), None)
        self._threads = _threads(self.jailed_pid)
        self._clean_up()
        self._park()

    def _stderr(self) -> str:
        """What bwrap wrote before it ended (its setup errors), capped."""
        assert self.proc.stderr is not None
        ready, _, _ = select.select([self.proc.stderr.fileno()], [], [], 0.5)
        return os.read(self.proc.stderr.fileno(), 2000).decode(errors="replace").strip() if ready else ""

    def _send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def _unsolicited(self) -> bool:
        """Bytes the worker sent that nobody asked for (it is between calls)."""
        assert self.proc.stdout is not None
        if self._buffer:
            return True
        ready, _, _ = select.select([self.proc.stdout.fileno()], [], [], 0)
        return bool(ready)

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
        answer = strict_json(line)
        return ("ok", answer) if isinstance(answer, dict) else ("protocol", None)

    def _clean_up(self) -> bool:
        """Kill whatever the last call left running in the jail; False if that failed."""
        return self.jail.cgroup.kill_except(self._keep)

    def _park(self) -> bool:
        """Between calls nothing of the jail runs. Other processes are killed (``_clean_up``);
        threads the reward started in the runner's own process are frozen with the whole jail
        (freezing every time doubled a trivial call's cost: only a runner that kept threads is
        frozen). Where this machine has no freezer, such a runner is a failure (replaced)."""
        if self.jailed_pid is None or _threads(self.jailed_pid) <= self._threads:
            return True
        return self.jail.freeze()

    def call(self, completion: str, item: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
        """("ok", {"reward", "extracted"} | {"error"}) or a failure status; on a failure the worker
        is dead (killed here) and must be replaced."""
        if self._unsolicited():
            self.kill()
            return "protocol", None
        self._seq += 1
        self.jail.thaw()
        try:
            self._send({"id": self._seq, "completion": completion, "item": item})
        except (BrokenPipeError, OSError):
            self.kill()
            return "died", None
        status, answer = self._receive(timeout_s)
        if status == "ok" and not valid_reply(answer, self._seq):
            status, answer = "protocol", None
        if status == "ok" and not (self._clean_up() and self._park()):
            self.kill()  # a fork bomb outran the kills, or threads ran on: the whole jail goes
        elif status != "ok":
            self.kill()
        return status, answer

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def kill(self) -> None:
        """The whole jail: bwrap's process group and everything in its cgroup."""
        self.jail.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def _threads(pid: int | None) -> int:
    """How many threads host process ``pid`` has (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


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
            "died": "reward process died (memory, CPU or a crash; the jail was killed)",
            "protocol": "reward process wrote to the reward protocol out of turn (the jail was "
                        "killed)"}[status]


def run_sandboxed(source: str, entrypoint: str, rows: list[dict[str, Any]], *, timeout_s: float = 10.0,
                  memory_mb: int | None = None, cpu_s: int | None = None) -> dict[str, Any]:
    """Validation: call ``entrypoint(completion, row)`` for each row (the row's ``completion``,
    else its ``answer``) in one jail. Returns {ok, results: [{reward}|{error}], error,
    network_isolated, elapsed_s, limits}; the whole run shares one deadline."""
    limits = dataclasses.replace(Limits.with_memory(memory_mb), cpu_s=cpu_s or Limits.cpu_s)
    report: dict[str, Any] = {"ok": False, "results": [], "error": None, "network_isolated": True,
                              "limits": {"timeout_s": timeout_s, "memory_mb": limits.memory_mb,
                                         "cpu_s": limits.cpu_s}}
    start = time.monotonic()
    try:
        # Start-up (the module's imports) counts against the same deadline as the calls.
        worker = JailedWorker({"kind": "source", "entrypoint": entrypoint}, source=source,
                              limits=limits, start_timeout_s=timeout_s)
    except RuntimeError as exc:
        error = str(exc).removeprefix("reward worker did not start: ")
        report["error"] = (f"timed out after {timeout_s:g}s while importing the module (start-up "
                           "counts against the deadline; the jail was killed)"
                           if error == "timeout" else error)
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
            report["results"].append({k: v for k, v in answer.items() if k not in ("extracted", "id")})
    finally:
        worker.kill()
    report["elapsed_s"] = time.monotonic() - start
    failures = [r for r in report["results"] if "error" in r]
    if failures and not report["error"]:
        report["error"] = f"{len(failures)} of {len(rows)} sample rows raised: {failures[0]['error']}"
    report["ok"] = report["error"] is None and len(report["results"]) == len(rows)
    return report
