"""The flow's line to the web app: status, events and the run's spec/cancel flag over HTTP with the
run's ingest token. Retries for a while, so a web app restart does not fail a run."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import httpx

from training_core.transport.http import WebClient

log = logging.getLogger(__name__)


class Tracker:
    def __init__(self, base_url: str, token: str, *, retry_window_s: float = 60.0):
        self.web = WebClient.for_run(base_url, token, retry_window_s=retry_window_s)
        self.base = self.web.base

    def run_info(self) -> dict[str, Any]:
        return self.web.get_json("/api/ingest/run/")

    def node_credential(self, provider: str) -> str:
        """A credential of the run for its nodes (the web app issues it to the run's flow only):
        the ingest endpoints of this run and nothing else, void once the run ends."""
        return self.web.post_json("/api/ingest/node-credential/",
                                  {"provider": provider})["credential"]

    def cancel_requested(self) -> bool:
        return bool(self.run_info().get("cancel_requested"))

    def status(self, status: str, reason: str = "") -> dict[str, Any]:
        return self.web.post_json("/api/ingest/status/", {"status": status, "reason": reason[:2000]})

    def event(self, kind: str, message: str, **data: Any) -> None:
        try:
            self.web.post_json("/api/ingest/events/", {"events": [{
                "kind": kind, "message": message[:4000], "data": data, "dedup_key": uuid.uuid4().hex}]})
        except httpx.HTTPError as exc:  # an event is not worth failing a run for
            log.warning("could not record event %s: %s", kind, exc)

    def close(self) -> None:
        self.web.close()
