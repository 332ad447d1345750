"""Metrics sinks. The trainer writes through :class:`training_core.api.MetricsSink`; the JSONL
sink is always on, the tracker's HTTP sink lives in ``training_core.tracking_sink``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from training_core.api import MetricsSink


class JsonlSink:
    """``metrics.jsonl`` (one line per step) and ``events.jsonl`` in the run directory."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics = (self.dir / "metrics.jsonl").open("a", buffering=1)
        self._events = (self.dir / "events.jsonl").open("a", buffering=1)
        self._trajectories = (self.dir / "trajectories.jsonl").open("a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._metrics.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def event(self, kind: str, message: str, **data: Any) -> None:
        self._events.write(json.dumps({"time": time.time(), "kind": kind, "message": message,
                                       **data}, default=str) + "\n")

    def trajectories(self, step: int, samples: list[dict[str, Any]]) -> None:
        for s in samples:
            self._trajectories.write(json.dumps({"step": step, **s}) + "\n")

    def checkpoint(self, step: int, version: int, path: str) -> None:
        pass  # the checkpoint directory itself is the local record

    def status(self, status: str, reason: str = "") -> None:
        pass  # events.jsonl has started/finished/failed

    def undelivered(self) -> list[dict[str, Any]]:
        return []  # written straight to the run directory

    def redeliver(self, records: list[dict[str, Any]]) -> None:
        pass  # the run directory's own files were truncated to the checkpoint on resume

    def close(self) -> None:
        self._metrics.close()
        self._events.close()
        self._trajectories.close()


def truncate_metrics(run_dir: str | Path, last_step: int) -> int:
    """On resume, forget steps after the checkpoint: they are redone, so each step appears once.
    Applies to the metrics and to the batch log (``batches.jsonl``); returns the metric lines
    dropped."""
    _truncate_steps(Path(run_dir) / BATCH_LOG, last_step)
    return _truncate_steps(Path(run_dir) / "metrics.jsonl", last_step)


# One line per step: which prompts (stream indices, see PromptLoader) the step trained on.
BATCH_LOG = "batches.jsonl"


def read_batch_log(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / BATCH_LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _truncate_steps(path: Path, last_step: int) -> int:
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError):
            dropped += 1  # a line torn by the kill
            continue
        if step <= last_step:
            kept.append(line)
        else:
            dropped += 1
    path.write_text("".join(k + "\n" for k in kept))
    return dropped


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metrics, one dict per step in step order of first appearance. A step may have
    more than one record in the file (an evaluation, which runs beside the next step, is logged
    at the step it was taken at when it finishes): they are merged, the step's own line winning
    a key both carry (its ``time``)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    steps: dict[Any, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written right now
            continue
        merged = steps.setdefault(record.get("step"), {})
        merged.update({k: v for k, v in record.items() if k not in merged})
    return list(steps.values())


def _each(sinks: list[MetricsSink], call: Any) -> None:
    """``call`` on every sink, even after one raised (its file on a full disk must not keep the
    tracker from hearing that the run failed); the first error is raised after."""
    first: BaseException | None = None
    for s in sinks:
        try:
            call(s)
        except Exception as exc:  # noqa: BLE001 - re-raised below
            first = first or exc
    if first is not None:
        raise first


class MultiSink:
    def __init__(self, sinks: list[MetricsSink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def event(self, kind: str, message: str, **data: Any) -> None:
        _each(self.sinks, lambda s: s.event(kind, message, **data))

    def trajectories(self, step: int, samples: list[dict[str, Any]]) -> None:
        for s in self.sinks:
            s.trajectories(step, samples)

    def checkpoint(self, step: int, version: int, path: str) -> None:
        for s in self.sinks:
            s.checkpoint(step, version, path)

    def status(self, status: str, reason: str = "") -> None:
        _each(self.sinks, lambda s: s.status(status, reason))

    def undelivered(self) -> list[dict[str, Any]]:
        return [r for s in self.sinks for r in s.undelivered()]

    def redeliver(self, records: list[dict[str, Any]]) -> None:
        for s in self.sinks:
            s.redeliver(records)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
