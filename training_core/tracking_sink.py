"""A MetricsSink that delivers to the web app's tracker over HTTP, and never loses a point.

Every ``log``/``event`` is appended to a local spool file first (fsync'd JSON lines), then a
background thread posts spooled records in batches with the run's ingest token. The tracker's
ingest is idempotent ((run, key, step) is unique; events carry a dedup key), so a batch that is
retried after a timeout never duplicates anything. While the web app is unreachable the spool
grows; when it comes back everything is delivered in order. On ``close`` the sink tries to drain
the spool for ``close_timeout_s``; what is left stays on disk and is delivered by the next sink
opened on the same spool directory (e.g. after a resume). A checkpoint carries the records not
yet delivered (``undelivered``), and a resume on another node re-sends them (``redeliver``): a
node lost between its checkpoint and its next delivery loses no step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from training_core.transport.http import ServerError, WebClient

log = logging.getLogger(__name__)


def _finite(value: Any) -> Any:
    """``value`` with every NaN and infinity made null, at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _dumps(record: dict[str, Any]) -> str:
    """Strict JSON (the tracker refuses NaN): non-finite numbers in events' data and samples'
    info go as null. The common case pays one encode."""
    try:
        return json.dumps(record, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(record), default=str, allow_nan=False)


class HttpSink:
    def __init__(self, base_url: str | None, token: str | None, *, spool_dir: str | Path,
                 flush_interval_s: float = 1.0, batch_size: int = 2000,
                 close_timeout_s: float = 30.0, timeout_s: float = 10.0):
        if not base_url or not token:
            raise ValueError("the http metrics sink needs metrics.tracker_url and metrics.tracker_token")
        self.web = WebClient.for_run(base_url, token, timeout_s=timeout_s)
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.spool = self.spool_dir / "pending.jsonl"
        self.cursor_file = self.spool_dir / "delivered.offset"
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self.close_timeout_s = close_timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.delivered = 0
        self.failures = 0
        self.rejected = 0  # requests the tracker refused for good (a 4xx other than 429)
        self._thread = threading.Thread(target=self._run, name="http-sink", daemon=True)
        self._thread.start()

    # ---- MetricsSink ---------------------------------------------------------------------

    def _append(self, *records: dict[str, Any]) -> None:
        lines = "".join(_dumps(r) + "\n" for r in records)
        try:
            with self._lock, self.spool.open("a") as fh:
                fh.write(lines)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            # The spool's disk is full (or gone): these records go straight to the tracker, once,
            # so a run failing for a full disk still reports it.
            log.error("metrics spool %s unwritable (%s): delivering %d records directly",
                      self.spool, exc, len(records))
            try:
                self._deliver([json.loads(line) for line in lines.splitlines()])
            except httpx.HTTPError as err:
                log.error("tracker unreachable too: %d records lost (%s)", len(records), err)
            return
        self._wake.set()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = time.time()
        # A NaN or inf goes as null (the tracker skips it): JSON has no NaN, and the tracker
        # refused a whole batch for one (up to 2,000 records, silently).
        self._append({"type": "metrics", "points": [
            {"key": k, "step": step, "value": v if math.isfinite(v) else None, "time": now}
            for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]})

    def event(self, kind: str, message: str, **data: Any) -> None:
        self._append({"type": "event", "event": {"kind": kind, "message": message, "data": data,
                                                 "dedup_key": uuid.uuid4().hex}})

    def trajectories(self, step: int, samples: list[dict[str, Any]]) -> None:
        self._append({"type": "trajectories", "samples": [{"step": step, **x} for x in samples]})

    def checkpoint(self, step: int, version: int, path: str) -> None:
        self._append({"type": "checkpoint", "step": step, "version": version, "path": path})

    def status(self, status: str, reason: str = "") -> None:
        self._append({"type": "status", "status": status, "reason": reason})

    def undelivered(self) -> list[dict[str, Any]]:
        records, _ = self._read_pending(None)
        return records

    def redeliver(self, records: list[dict[str, Any]]) -> None:
        if records:
            self._append(*records)

    def close(self) -> None:
        deadline = time.monotonic() + self.close_timeout_s
        while self._has_pending() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.1)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.web.close()
        if left := self.pending():
            log.warning("tracker unreachable: %d records kept in %s for later delivery",
                        left, self.spool)

    # ---- delivery ------------------------------------------------------------------------

    def _offset(self) -> int:
        try:
            return int(self.cursor_file.read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def _read_pending(self, limit: int | None) -> tuple[list[dict[str, Any]], int]:
        offset = self._offset()
        if not self.spool.exists():
            return [], offset
        records, end = [], offset
        with self._lock, self.spool.open("rb") as fh:
            fh.seek(offset)
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break  # a record still being written
                records.append(json.loads(raw))
                end += len(raw)
                if limit is not None and len(records) >= limit:
                    break
        return records, end

    def pending(self) -> int:
        records, _ = self._read_pending(None)
        return len(records)

    def _has_pending(self) -> bool:
        # The spool only grows; anything past the delivered offset is pending. No parsing.
        return self.spool.exists() and self.spool.stat().st_size > self._offset()

    def _post(self, path: str, payload: dict[str, Any]) -> bool:
        """True if the tracker took it. One try: the delivery loop below is the retry (the
        records wait in the spool, for as long as it takes), and so for a 429 (the run's ingest
        rate). Another 4xx will not heal by retrying: False, after recording it."""
        try:
            self.web.request("POST", path, json=payload, retry=False)
        except ServerError:
            raise
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 429:
                raise
            log.error("tracker rejected %s: %s", path, exc)
            self.rejected += 1
            return False
        return True

    def _post_each(self, path: str, field: str, parts: list[list[Any]]) -> None:
        """``parts`` (one list per spooled record) in one request; if the tracker refuses it,
        record by record, so one bad record never costs the others their delivery."""
        items = [x for part in parts for x in part]
        if items and not self._post(path, {field: items}) and len(parts) > 1:
            for part in parts:
                if part:
                    self._post(path, {field: part})

    def _deliver(self, records: list[dict[str, Any]]) -> None:
        self._post_each("/api/ingest/metrics/", "points",
                        [r["points"] for r in records if r["type"] == "metrics"])
        self._post_each("/api/ingest/events/", "events",
                        [[r["event"]] for r in records if r["type"] == "event"])
        self._post_each("/api/ingest/trajectories/", "samples",
                        [r["samples"] for r in records if r["type"] == "trajectories"])
        for r in records:
            if r["type"] == "checkpoint":
                self._post("/api/ingest/checkpoints/", {k: r[k] for k in ("step", "version", "path")})
            if r["type"] == "status":
                self._post("/api/ingest/status/", {"status": r["status"], "reason": r["reason"]})

    def _run(self) -> None:
        backoff = self.flush_interval_s
        while True:
            self._wake.wait(timeout=backoff)
            self._wake.clear()
            records, end = self._read_pending(self.batch_size)
            if records:
                try:
                    self._deliver(records)
                except httpx.HTTPError as exc:
                    self.failures += 1
                    backoff = min(backoff * 2, 30.0)
                    log.warning("tracker unreachable (%s); %d records spooled", exc, len(records))
                    if self._stop:
                        return
                    continue
                self.cursor_file.write_text(str(end))
                self.delivered += len(records)
                backoff = self.flush_interval_s
                if self._has_pending():
                    self._wake.set()
                continue
            if self._stop:
                return
