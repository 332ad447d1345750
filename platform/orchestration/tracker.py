"""The flow's line to the web app: status, events and the run's spec/cancel flag over HTTP with the
run's ingest token. Retries for a while, so a web app restart does not fail a run."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import httpx

log = logging.getLogger(__name__)


class Tracker:
    def __init__(self, base_url: str, token: str, *, retry_window_s: float = 60.0):
        self.base = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base, timeout=30,
                                 headers={"Authorization": f"Bearer {token}"})
        self.retry_window_s = retry_window_s

    def _call(self, method: str, path: str, **kw) -> Any:
        deadline = time.monotonic() + self.retry_window_s
        delay = 0.5
        while True:
            try:
                resp = self.http.request(method, path, **kw)
                if resp.status_code < 500:
                    resp.raise_for_status()
                    return resp.json()
                err: Exception = httpx.HTTPStatusError(str(resp.status_code), request=resp.request,
                                                       response=resp)
            except httpx.TransportError as exc:
                err = exc
            if time.monotonic() > deadline:
                raise err
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def run_info(self) -> dict[str, Any]:
        return self._call("GET", "/api/ingest/run/")

    def status(self, status: str, reason: str = "") -> dict[str, Any]:
        return self._call("POST", "/api/ingest/status/", json={"status": status, "reason": reason[:2000]})

    def event(self, kind: str, message: str, **data: Any) -> None:
        try:
            self._call("POST", "/api/ingest/events/", json={"events": [{
                "kind": kind, "message": message[:4000], "data": data, "dedup_key": uuid.uuid4().hex}]})
        except httpx.HTTPError as exc:  # an event is not worth failing a run for
            log.warning("could not record event %s: %s", kind, exc)

    def close(self) -> None:
        self.http.close()
