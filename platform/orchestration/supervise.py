"""Watch a running trainer and its rollout fleet until the run ends, one way or another.

Decisions, in order, every poll:
- the trainer exited: 0 -> succeeded; otherwise failed, with the signal or exit code and the
  tail of its log as the reason;
- a rollout server died: it is restarted (up to ``max_server_restarts`` times each) and loaded
  with the latest pushed weights, so the trainer's client, which retries, carries on; past the
  limit the run fails cleanly;
- cancellation was requested in the web app: the trainer is stopped, the run is cancelled;
- no progress (metrics.jsonl untouched) for ``heartbeat_timeout_s``: failed as stalled.
New error lines of the trainer log go to the run's event log as they appear.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestration.tracker import Tracker
from training_core.processes import Fleet, ManagedProcess


@dataclass
class Outcome:
    status: str  # succeeded | failed | cancelled
    reason: str = ""
    recoverable: bool = False  # a placed run may resume from the durable store elsewhere
    lost_nodes: tuple[int, ...] = ()  # nodes not to place on again


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"trainer killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"trainer killed by signal {-returncode}"
    return f"trainer exited with code {returncode}"


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def supervise(tracker: Tracker, trainer: ManagedProcess, fleet: Fleet, run_dir: Path, *,
              trainer_log: Path, restart_server: Callable[[int], None], stop_trainer: Callable[[], None],
              poll_s: float = 0.5, cancel_poll_s: float = 2.0, heartbeat_timeout_s: float = 900.0,
              max_server_restarts: int = 2) -> Outcome:
    restarts = [0] * len(fleet.urls)
    last_cancel_check = 0.0
    metrics = run_dir / "metrics.jsonl"
    last_progress = time.monotonic()
    last_size = -1
    log_offset = 0
    while True:
        rc = trainer.poll()
        log_offset = _forward_errors(tracker, trainer_log, log_offset)
        if rc is not None:
            if rc == 0:
                return Outcome("succeeded")
            tail = log_tail(trainer_log, 15)
            return Outcome("failed", describe_exit(rc) + (f"\n{tail}" if tail else ""))

        for i, alive in enumerate(fleet.alive()):
            if alive:
                continue
            if restarts[i] >= max_server_restarts:
                stop_trainer()
                return Outcome("failed", f"rollout server {i} died {restarts[i] + 1} times; giving up")
            restarts[i] += 1
            tracker.event("rollout_server_died", f"rollout server {i} died; restarting "
                          f"({restarts[i]}/{max_server_restarts})", url=fleet.urls[i])
            restart_server(i)
            tracker.event("rollout_server_restarted", f"rollout server {i} is back", url=fleet.urls[i])

        now = time.monotonic()
        if now - last_cancel_check >= cancel_poll_s:
            last_cancel_check = now
            try:
                if tracker.cancel_requested():
                    stop_trainer()
                    return Outcome("cancelled", "cancelled by user")
            except Exception:  # noqa: BLE001 - the web app may be restarting; try again later
                pass

        size = metrics.stat().st_size if metrics.exists() else 0
        if size != last_size:
            last_size, last_progress = size, now
        elif now - last_progress > heartbeat_timeout_s:
            stop_trainer()
            return Outcome("failed", f"trainer made no progress for {heartbeat_timeout_s:.0f}s")
        time.sleep(poll_s)


def _forward_errors(tracker: Tracker, path: Path, offset: int) -> int:
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return offset
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].decode(errors="replace").splitlines():
        if "Traceback" in line or " ERROR " in line or "Error:" in line:
            tracker.event("trainer_log", line.strip())
    return offset + end
